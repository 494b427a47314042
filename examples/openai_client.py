"""Talk to `adaptive serve` with the official OpenAI client (pip install openai).

    adaptive serve --profile adaptive-profile            # in another terminal
    python examples/openai_client.py                     # or ADAPTIVE_URL=http://host:port/v1
"""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("ADAPTIVE_URL", "http://localhost:8000/v1"),
                api_key=os.environ.get("ADAPTIVE_API_KEY", "none"))  # any key unless the server has --api-key
model = client.models.list().data[0].id

# one answer; usage.adaptive says how it was decoded (routed domain, drafter, acceptance)
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 17 * 23?"}],
                                   max_tokens=64, temperature=0)
print(r.choices[0].message.content)
print(r.usage.model_extra["adaptive"])

# streamed, with speculation switched off for this request only
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a haiku"}],
                                            max_tokens=32, temperature=0, stream=True,
                                            extra_body={"speculation": "off"}):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
