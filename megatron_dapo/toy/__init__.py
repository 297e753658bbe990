"""The CPU demo, in one place: a synthetic verifiable task (task.py), its tiny HF-format tokenizer
(tokenizer.py), a tiny Qwen2 base that knows the answer format but not the task (base.py), and the
bootstrap that makes them inside a run directory (bootstrap.py, the trainer's one entry point).

Nothing on the main path (config -> set-up -> actor -> loop -> checkpoint) imports this package
unless ``toy.enable`` is set; tests/unit/test_boundaries.py checks. The settings live with every
other default, in ``config.ToyConfig`` (the ``toy:`` section).
"""
