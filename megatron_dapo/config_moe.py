"""The mixture-of-experts section of the config schema (``moe``): how tokens reach their experts, the
router's auxiliary losses, and rollout routing replay. The keys act only on a model with experts
(Qwen3-MoE); one is checked for any: R3 on a dense model is refused in one line. The expert-parallel
size is ``parallel.expert_model_parallel_size``."""

from dataclasses import dataclass
from typing import Literal

from megatron_dapo.config_fields import at_least, fail, require, setting

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    token_dispatcher: Literal["auto", "allgather", "alltoall"] = setting(
        "auto", "how tokens reach their experts' EP ranks (megatron's moe_token_dispatcher_type); auto = alltoall on "
                "GPU, allgather on CPU (where alltoall runs too, through two shims of cpu_compat: set it to try "
                "the GPU's path)")
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = setting(
        "aux_loss", "the router's load-balancing loss (megatron's moe_router_load_balancing_type): over each "
                    "micro-batch's tokens as transformers' Qwen3-MoE computes it, per sequence, or over the global "
                    "batch; none = no such loss")
    aux_loss_coeff: float | Literal["auto"] = setting(
        AUTO, "weight of the load-balancing loss; auto = the checkpoint's router_aux_loss_coef (Qwen3-MoE: 0.001)")
    z_loss_coeff: float = setting(0.0, "weight of the router z-loss (ST-MoE); Qwen3-MoE trains without one")
    router_replay: Literal["disabled", "R3"] = setting(
        "disabled", "R3 (rollout routing replay): the trainer routes each token to the experts the rollout engine "
                    "chose for it, for pi_old and the update; disabled = the trainer's router decides")

    def __post_init__(self):
        require("moe", self, z_loss_coeff=at_least(0.0))
        if self.aux_loss_coeff != AUTO and self.aux_loss_coeff < 0:
            fail(f"moe.aux_loss_coeff must be >= 0 or auto, got {self.aux_loss_coeff}")
