"""What a run reports: metric writers (JSON lines, TensorBoard, W&B), the
progress line and bar, start-up phases, host memory, pass@k.

Layer 1: may import `core` only.
"""
