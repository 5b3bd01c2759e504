"""Fast paths for the base model's own work, each with the plain-torch code it replaces as its reference: packed
varlen attention (packed_attention.py), Triton norms / rotary / activation (fused_elementwise.py,
triton_elementwise.py) and the Triton LM-head log-softmax (triton_lm_head.py)."""
