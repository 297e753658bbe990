"""Seeing what the policy does: sample dumps, alarms, the pass-rate ledger, profiler traces, the report.

docs/observability.md is the user's guide. Nothing here imports megatron or vllm; the loop
(train.py) feeds these pieces and they write under ``logging.dir``.
"""
