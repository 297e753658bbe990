"""The CPU demo's section of the config schema (``toy``): the synthetic task and the tiny base model
made under logging.dir (toy/bootstrap.py), of the Qwen2, Qwen3 dense or Qwen3-MoE architecture."""

from dataclasses import dataclass

from megatron_dapo.config_fields import above, at_least, fail, require, setting

TOY_ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe")  # toy.architecture


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    enable: bool = setting(False, "CPU demo: make the toy task and a tiny warmed-up base under logging.dir, train on "
                           "it")
    num_digits: int = setting(5, "digits per problem; the answer is the largest")
    min_digits: int = setting(0, "fewest digits per problem: lengths uniform in [min_digits, num_digits], so responses "
                            "with the reasoning line vary in length; 0 = every problem has num_digits")
    num_train: int = setting(2000, "training problems (unique, disjoint from validation)")
    num_val: int = setting(128, "held-out problems for evaluation")
    architecture: str = setting("qwen2", "the base's architecture: qwen2 (Qwen2.5's layout: QKV biases), qwen3 "
                                "(Qwen3 dense: no biases, RMSNorm over each head's query and key) or qwen3_moe "
                                "(Qwen3's attention, every MLP a router over toy.num_experts experts)")
    hidden_size: int = setting(64, "model width")
    head_dim: int = setting(0, "with architecture=qwen3: size of an attention head; 0 = hidden_size / "
                            "num_attention_heads (Qwen3 sets its own: 0.6B has 16 heads of 128 over a width of 1024)")
    intermediate_size: int = setting(192, "SwiGLU MLP width")
    num_experts: int = setting(8, "with architecture=qwen3_moe: routed experts per layer")
    num_experts_per_tok: int = setting(2, "with architecture=qwen3_moe: experts each token is routed to (>= 2)")
    moe_intermediate_size: int = setting(96, "with architecture=qwen3_moe: one expert's SwiGLU width (top-2 of 96: the "
                                             "dense toy's 192 active)")
    num_layers: int = setting(2, "transformer layers")
    num_attention_heads: int = setting(4, "query heads")
    num_key_value_heads: int = setting(2, "key/value heads (GQA, as Qwen2.5)")
    tie_word_embeddings: bool = setting(True, "share input embedding and output layer (as Qwen2.5-0.5B)")
    max_position_embeddings: int = setting(128, "RoPE context the model is built for")
    warmup_steps: int = setting(150, "supervised warm-up steps (teaches the format with random answers)")
    warmup_batch_size: int = setting(64, "sequences per warm-up step")
    warmup_lr: float = setting(3e-3, "AdamW learning rate of the warm-up")
    reasoning_prob: float = setting(0.5, "fraction of warm-up responses with the optional reasoning line")

    def __post_init__(self):
        one = at_least(1)
        require("toy", self, num_digits=at_least(2), num_train=one, num_val=one, hidden_size=one,
                intermediate_size=one, num_layers=one, num_attention_heads=one, num_key_value_heads=one,
                max_position_embeddings=one, warmup_steps=at_least(0), warmup_batch_size=one,
                 warmup_lr=above(0), reasoning_prob=((lambda v: 0 <= v <= 1), "in [0, 1]"), head_dim=at_least(0),
                 architecture=((lambda v: v in TOY_ARCHITECTURES), f"one of {', '.join(TOY_ARCHITECTURES)}"))
        # at least 2: the toy renormalises the top-k weights, and one renormalised weight is a constant 1
        require("toy", self, num_experts=one, num_experts_per_tok=at_least(2), moe_intermediate_size=one)
        if self.num_experts_per_tok > self.num_experts:
            fail(f"toy.num_experts_per_tok={self.num_experts_per_tok} exceeds toy.num_experts={self.num_experts}")
        if self.head_dim and self.architecture == "qwen2":
            fail(f"toy.head_dim={self.head_dim} needs toy.architecture=qwen3 or qwen3_moe: Qwen2's head size is "
                 "toy.hidden_size / toy.num_attention_heads (vLLM's Qwen2 reads no head_dim)")
        if (self.head_dim == 0 and self.hidden_size % self.num_attention_heads) or \
                self.num_attention_heads % self.num_key_value_heads:
            fail(f"toy.hidden_size={self.hidden_size} must be a multiple of toy.num_attention_heads="
                 f"{self.num_attention_heads} (or set toy.head_dim), and that of toy.num_key_value_heads="
                 f"{self.num_key_value_heads}")
        if self.min_digits and not 2 <= self.min_digits <= self.num_digits:
            fail(f"toy.min_digits={self.min_digits} must be in [2, toy.num_digits={self.num_digits}] (or 0 = fixed "
                 "length)")
