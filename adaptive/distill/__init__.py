"""DistillSpec-style distillation of drafters towards the target model (``adaptive distill``).

:mod:`~adaptive.distill.divergences` holds the token-level divergences, :mod:`~adaptive.distill.data`
the training data (the target's own generations, the drafter's samples, or the prompt text), and
:mod:`~adaptive.distill.trainer` the training loop with checkpoints and resume.
"""
