"""Model building blocks shared by every supported architecture (Mamba-2, attention, MoE, MLP, norms)."""
