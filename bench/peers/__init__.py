"""bench/compare.py's peers, one module per op family beside one shared helper:

  common   imports, timing (eager / CUDA graph, event medians), the copy ceiling, rotating input sets, Row, tables
  gate     fused_gate: torch biased grouped top-k (eager, graph, torch.compile), FlashInfer fused_topk_deepseek
  permute  permute and unpermute_reduce: torch argsort + index_select (+ fp8 quantization), gather / index_add_
  gemm     grouped GEMM: torch._scaled_grouped_mm, torch._grouped_mm
  decode   attention decode: FlashInfer paged decode (CUDA-core / tensor-core, bf16 / fp8 KV), torch SDPA (cuDNN,
           flash), flash_attn_with_kvcache
  moe_layer  the whole MoE layer: tessera's ops composed with torch glue, a torch eager layer, torch.compile of it
  merge    runs tessera-bench --json and joins its rows (and its C++ peers) with the Python peers' on case names

Each family module has registry() (tessera-bench's case names for its ops, in its order), parse(op, name) (a case
name to the shape it stands for, or None) and rows(cases, args) (the measured Rows).
"""
