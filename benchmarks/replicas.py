"""Many replicas, one profile (issue 45's benchmark): `adaptive serve` processes over one profile copy.

Scenario A (replicas): a copy of ``--profile`` (calibrated without the domain of ``--data``), three
servers on it (``--replica-id r0 r1 r2``, online learning on). The first ``3 * --per-replica``
prompts of ``--data`` after ``--skip`` are sent one at a time, to each replica in turn (so no replica
alone sees ``min_cluster`` of them); then ``r1`` is SIGKILLed and restarted. The script waits (at most
``--wait`` s) until every replica reports exactly one learned domain, starts a fourth replica
``r3`` on the same directory, reads its merged state, and sends it the next ``--eval`` prompts twice
each, with speculation ``auto`` and ``off`` (plain decoding), in alternating order, after one unmeasured
request of each (a prompt it learned from): the speedup is the ratio of their summed client-side wall
times.

Scenario B (one replica): a fresh copy, one server that sees the same prompts alone, then the same
evaluation. Reported: the requests the fourth replica counts, the learned domains, the routes of the
evaluation prompts, both speedups and their ratio, every HTTP status (a 5xx is a failure; in A each
request is followed by a malformed one from ``serve_load.py``, which must get a 4xx), whether every
overlay file loads, and each replica's merges (count, milliseconds, share of its requests' time).

Part C (``--cost-rounds``, after A): merging's cost. One more server over A's directory, whose other
replicas' files a thread rewrites every second, serves ``--clients`` concurrent clients with merging
every 2 s and with merging only at start, in alternating rounds: aggregate tokens per second.

    python benchmarks/replicas.py --profile /tmp/p43/no-tr --data /tmp/sb/translation.jsonl --out /tmp/replicas.json
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_load import invalid_bodies  # noqa: E402  (its malformed requests)


def prompts_of(path: Path, skip: int) -> list[str]:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][skip:]


class Server:
    """One `adaptive serve` process on a free port, its stderr kept."""

    def __init__(self, profile: Path, replica: str, extra: list[str]):
        self.replica = replica
        self.lines: list[str] = []
        cmd = [sys.executable, "-m", "adaptive.cli.main", "serve", "--profile", str(profile), "--port", "0",
               "--replica-id", replica, *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.port = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                m = re.search(r"serving .* on http://[\d.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600) or self.port is None:
            raise RuntimeError(f"replica {replica} did not start: {self.lines[-5:]}")

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t = time.perf_counter()
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        dt = time.perf_counter() - t
        try:
            return resp.status, json.loads(data), dt
        except ValueError:
            return resp.status, {"raw": data[:200].decode(errors="replace")}, dt

    def post_raw(self, path: str, body: bytes) -> int:
        """POST raw bytes (a malformed request): the status."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status

    def online(self) -> dict:
        return self.call("GET", "/v1/adaptive/online")[1]

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def chat(server: Server, prompt: str, max_tokens: int, speculation: str, statuses: list[int]) -> dict:
    status, body, dt = server.call("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
        "speculation": speculation})
    statuses.append(status)
    ext = body.get("usage", {}).get("adaptive", {}) if status == 200 else {}
    return {"status": status, "seconds": dt, "applied": ext.get("applied"), "domain": ext.get("domain"),
            "drafter": ext.get("drafter"), "tokens": body.get("usage", {}).get("completion_tokens"),
            "text": body["choices"][0]["message"]["content"] if status == 200 else None}


def wait_learned(servers: list[Server], seconds: float) -> tuple[bool, float]:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        names = [tuple(sorted(s.online().get("learned", {}))) for s in servers]
        if all(len(n) == 1 for n in names) and len(set(names)) == 1:
            return True, time.perf_counter() - t
        time.sleep(2)
    return False, time.perf_counter() - t


def evaluate(server: Server, prompts: list[str], max_tokens: int, statuses: list[int], warm: str) -> dict:
    for s in ("auto", "off"):  # warm-up, not measured: a fresh process's first requests pay one-time costs
        chat(server, warm, max_tokens, s, statuses)
    runs = []
    for i, p in enumerate(prompts):
        order = ("auto", "off") if i % 2 == 0 else ("off", "auto")
        out = {s: chat(server, p, max_tokens, s, statuses) for s in order}
        runs.append({"applied": out["auto"]["applied"], "drafter": out["auto"]["drafter"],
                     "auto_s": out["auto"]["seconds"], "off_s": out["off"]["seconds"],
                     "same_text": out["auto"]["text"] == out["off"]["text"]})
    auto, off = sum(r["auto_s"] for r in runs), sum(r["off_s"] for r in runs)
    return {"speedup": round(off / auto, 4) if auto else None, "runs": runs,
            "routed": [r["applied"] for r in runs], "same_text": sum(r["same_text"] for r in runs)}


def throughput_with_merging(prof: Path, prompts: list[str], clients: int, per_client: int, max_tokens: int,
                            extra: list[str], statuses: list[int], rounds: int) -> dict:
    """Part C: one server over ``prof`` (whose other replicas' files a thread rewrites every second, as
    live replicas would) serves ``clients`` concurrent clients, ``per_client`` requests each, with
    merging every 2 s (``on``) and only at start (``off``), in alternating rounds: tokens per second.
    The server's own file is removed after each round, so every round starts from the same state."""
    from adaptive.profile.overlay import load_overlay, overlay_path, replica_dir, save_overlay

    folder = replica_dir(overlay_path(prof))
    others = sorted(folder.glob("*.online"))
    stop = threading.Event()

    def churn():
        while not stop.wait(1.0):
            for f in others:
                ov = load_overlay(f)
                save_overlay(dataclasses.replace(ov, generation=ov.generation + 1), f)

    threading.Thread(target=churn, daemon=True).start()
    out: dict = {"on": [], "off": [], "merges": {"on": [], "off": []}}
    try:
        for i in range(rounds):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                interval = "2" if mode == "on" else "1e9"
                server = Server(prof, "cost", [*extra, "--merge-interval", interval])
                chat(server, prompts[0], max_tokens, "auto", statuses)  # warm-up
                tokens: list[int] = []

                def client(c: int, server=server, tokens=tokens):
                    for j in range(per_client):
                        r = chat(server, prompts[(c * per_client + j) % len(prompts)], max_tokens, "auto", statuses)
                        tokens.append(r["tokens"] or 0)

                t = time.perf_counter()
                threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                dt = time.perf_counter() - t
                out[mode].append(round(sum(tokens) / dt, 3))
                out["merges"][mode].append(server.online().get("merges"))
                server.stop()
                (folder / "cost.online").unlink(missing_ok=True)
    finally:
        stop.set()
    on, off = sum(out["on"]) / len(out["on"]), sum(out["off"]) / len(out["off"])
    out["on_over_off"] = round(on / off, 4)
    return out


def merge_cost(server: Server, request_s: float) -> dict:
    st = server.online()
    return {"merges": st.get("merges"), "merge_ms": st.get("merge_ms"), "request_s": round(request_s, 2),
            "share": round(st.get("merge_ms", 0) / 1e3 / request_s, 5) if request_s else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a profile calibrated without the domain of --data")
    ap.add_argument("--data", required=True, help="that domain's prompts (JSONL: prompt or turns)")
    ap.add_argument("--skip", type=int, default=16, help="prompts calibration may have seen")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--per-replica", type=int, default=6)
    ap.add_argument("--eval", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for the domain to be learned")
    ap.add_argument("--clients", type=int, default=8, help="part C's concurrent clients")
    ap.add_argument("--per-client", type=int, default=4, help="part C's requests per client and round")
    ap.add_argument("--cost-rounds", type=int, default=2, help="part C's rounds of merging on and off (0: no C)")
    ap.add_argument("--serve-args", default="", help="more `adaptive serve` options, one string")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from adaptive.profile.overlay import load_replicas, overlay_path

    prompts = prompts_of(Path(args.data), args.skip)
    n = args.replicas * args.per_replica
    learn, held = prompts[:n], prompts[n:n + args.eval]
    extra = args.serve_args.split()
    statuses: list[int] = []
    report: dict = {"settings": vars(args)}
    work = Path(tempfile.mkdtemp(prefix="replicas-"))
    servers: list[Server] = []
    try:
        # A: replicas
        prof = work / "a" / Path(args.profile).name
        shutil.copytree(args.profile, prof)
        servers = [Server(prof, f"r{i}", extra) for i in range(args.replicas)]
        spent = {s.replica: 0.0 for s in servers}
        sent = []
        model = servers[0].call("GET", "/v1/models")[1]["data"][0]["id"]
        probes = [b for _, b in invalid_bodies(model)]
        probe_statuses: list[int] = []
        for i, p in enumerate(learn):
            s = servers[i % args.replicas]
            r = chat(s, p, args.max_tokens, "auto", statuses)
            spent[s.replica] += r["seconds"]
            sent.append({"replica": s.replica, "applied": r["applied"], "domain": r["domain"]})
            # a hostile probe (serve_load.py's malformed bodies) while the replicas save their buffers
            probe_statuses.append(s.post_raw("/v1/chat/completions", probes[i % len(probes)]))
        report["a_sent"] = sent
        report["a_probes"] = {str(c): probe_statuses.count(c) for c in sorted(set(probe_statuses))}
        statuses += [c for c in probe_statuses if c >= 500]
        report["a_before_kill"] = {s.replica: s.online() for s in servers}
        killed = servers[1]
        before = report["a_before_kill"][killed.replica]
        killed.stop(signal.SIGKILL)
        servers[1] = Server(prof, killed.replica, extra)
        ok, waited = wait_learned(servers, args.wait)
        report["a_learned"] = {"ok": ok, "waited_s": round(waited, 1),
                               "names": {s.replica: sorted(s.online().get("learned", {})) for s in servers}}
        fourth = Server(prof, f"r{args.replicas}", extra)
        servers.append(fourth)
        st = fourth.online()
        report["a_fourth"] = {"requests": st.get("requests"), "learned": sorted(st.get("learned", {})),
                              "replicas": {r: v.get("requests") for r, v in st.get("replicas", {}).items()},
                              "killed_requests_before_kill": before.get("own_requests")}
        report["a_eval"] = evaluate(fourth, held, args.max_tokens, statuses, learn[0])
        report["a_merge_cost"] = {s.replica: merge_cost(s, spent.get(s.replica, 0.0)) for s in servers[:1]}
        for s in servers:
            s.stop()
        report["a_files_load"] = sorted(load_replicas(overlay_path(prof)))  # raises on a torn or damaged file
        servers = []
        if args.cost_rounds:  # C: merging's cost at --clients concurrent clients
            report["c_merging"] = throughput_with_merging(prof, held + learn, args.clients, args.per_client,
                                                          args.max_tokens, extra, statuses, args.cost_rounds)
        # B: one replica sees it all
        prof_b = work / "b" / Path(args.profile).name
        shutil.copytree(args.profile, prof_b)
        alone = Server(prof_b, "alone", extra)
        servers = [alone]
        for p in learn:
            chat(alone, p, args.max_tokens, "auto", statuses)
        ok_b, waited_b = wait_learned([alone], args.wait)
        report["b_learned"] = {"ok": ok_b, "waited_s": round(waited_b, 1),
                               "names": sorted(alone.online().get("learned", {}))}
        report["b_eval"] = evaluate(alone, held, args.max_tokens, statuses, learn[0])
        alone.stop()
        servers = []
    finally:
        for s in servers:
            s.stop(signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    a, b = report.get("a_eval", {}).get("speedup"), report.get("b_eval", {}).get("speedup")
    report["speedup_ratio"] = round(a / b, 4) if a and b else None
    report["statuses"] = {str(c): statuses.count(c) for c in sorted(set(statuses))}
    report["fivexx"] = sum(1 for c in statuses if c >= 500)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    summary = {k: report.get(k) for k in ("a_learned", "a_fourth", "b_learned", "speedup_ratio", "statuses",
                                          "a_probes", "a_merge_cost", "a_files_load", "c_merging")}
    summary["a_routed"] = report.get("a_eval", {}).get("routed")
    summary["speedups"] = [a, b]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
