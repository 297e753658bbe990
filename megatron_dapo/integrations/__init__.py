"""Optional adapters that place our DAPO pieces in other frameworks; each is import-guarded.

``nemo_aligner``: a DAPO actor on NeMo-Aligner 0.7.0's Megatron GPT PPO actor and a critic-free trainer
hook on its ReinforceTrainer (``dapo_actor_class()``, ``dapo_trainer_class()``), with the example
config ``nemo_aligner_dapo.yaml``. Importing it needs neither NeMo nor megatron; building the classes
needs NeMo-Aligner's stack and says what to install otherwise (docs/nemo_aligner.md).
"""
