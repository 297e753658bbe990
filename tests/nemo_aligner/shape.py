"""The tiny actor's shape and the probes' group size, with no imports: read by the NeMo side (tiny.py,
in .venv-nemo) and by our side (ours_side.py, in .venv) alike."""

SHAPE = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "seq_length": 64}
VOCAB, EOS = 140, 137  # the toy tokenizer's (megatron_dapo/toy/tokenizer.py): eos = <|endoftext|>
GROUP = 4  # responses per prompt in the probes
