"""Model shapes by name. Plain dicts so the job spec can import them without torch."""

PRESETS: dict[str, dict[str, int | bool]] = {
    # Tests and the CPU demo: ~0.2M parameters, byte-level vocabulary (256 bytes + EOS, padded).
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=264,
                 max_seq_len=256),
    # A few-minute CPU/GPU smoke model: ~6M parameters.
    "small": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=264,
                  max_seq_len=1024),
    # Llama-3.2-1B-like shape.
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, max_seq_len=8192, tie_embeddings=True),
    # Llama-3-8B-like shape.
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, max_seq_len=8192),
    # Llama-3-70B-like shape.
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                vocab_size=128256, max_seq_len=8192),
}
