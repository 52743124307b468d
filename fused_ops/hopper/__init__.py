"""Hopper's (sm_90) Gluon ping-pong kernels, the fast path of the core's linear_act forward and dgrad, and the
classifier's logits GEMM (with each row's log-sum-exp per tile beside the logits).

Read pingpong.py (the kernel, its launchers and usable(): what it runs on), then dispatch.py (how the core reaches it:
through fused_ops/backends.py, never by importing it). The core runs without this package; this package imports the
core's building blocks (matmul's tile order and column split, the activations, tuning's specialization) and never
fp8/ (fp8/hopper.py launches this kernel's FP8-output variants; its FP8-input ones are launched here too).
"""

from . import dispatch, pingpong  # noqa: F401  (dispatch registers the kernels with fused_ops.backends)
