"""
A small GPT in plain PyTorch, in the spirit of nanoGPT.

One config field, `mlp`, picks how the MLP runs: "eager" (plain PyTorch, below), "fused" (our Triton
kernels in fused_ops/) or "auto" (fused when the tensors are on a CUDA GPU and Triton works, eager
otherwise). Both paths own exactly the same parameters, so a checkpoint trained one way loads the other.
GPT.from_pretrained loads OpenAI's GPT-2 (Hugging Face checkpoints) into the same GPT, so either MLP runs it, and
GPT.save_pretrained writes ours in that format; the files themselves are helpers/hf_gpt2.py's.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


# Plain activations act on the whole hidden vector.
PLAIN_ACTIVATIONS = {
    "gelu": F.gelu,  # the exact erf form
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's (transformers' "gelu_new")
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Primer)
}
# Gated activations (the GLU family) combine two halves of c_fc's output: a gate and an "up" projection.
GATED_ACTIVATIONS = {
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "geglu": lambda gate, up: F.gelu(gate) * up,
    "geglu_tanh": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "sigmoid_tanh": lambda gate, up: torch.sigmoid(gate) * torch.tanh(up),
}
MLP_KINDS = ("eager", "fused", "auto")
CLASSIFIER_KINDS = ("eager", "fused", "fp8")
FP8_REACHES = ("mlp", "blocks")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2
    mlp: str = "eager"  # "eager" | "fused" | "auto"
    activation: str = "gelu"  # a key of PLAIN_ACTIVATIONS or GATED_ACTIVATIONS
    fuse_ln: bool = False  # fold each block's second LayerNorm into the fused MLP's first matmul
    fp8: bool = False  # train the fused MLP's GEMMs in FP8 (fused_ops/fp8/); never chosen by "auto"
    fp8_reach: str = "mlp"  # with fp8: "mlp" | "blocks" (the attention's projections too; the LM head: classifier)
    classifier: str = "eager"  # "eager" | "fused" (LM head + cross-entropy as one operator) | "fp8" (its FP8 form)

    def __post_init__(self):
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"config key 'mlp' must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.classifier not in CLASSIFIER_KINDS:
            raise ValueError(f"config key 'classifier' must be one of {CLASSIFIER_KINDS}, got {self.classifier!r}")
        known = list(PLAIN_ACTIVATIONS) + list(GATED_ACTIVATIONS)
        if self.activation not in known:
            raise ValueError(f"config key 'activation' must be one of {known}, got {self.activation!r}")
        for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                raise ValueError(f"config key {key!r} must be positive, got {getattr(self, key)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config key 'dropout' must be in [0, 1), got {self.dropout}")
        if self.fuse_ln and self.mlp == "eager":
            raise ValueError("config key 'fuse_ln' folds the LayerNorm into the fused MLP: it needs mlp='fused' "
                             "or 'auto', got mlp='eager'")
        if self.fp8 and (self.mlp != "fused" or self.fuse_ln):
            raise ValueError(f"config key 'fp8' runs the fused MLP's FP8 kernels: it needs mlp='fused' and "
                             f"fuse_ln=False, got mlp={self.mlp!r}, fuse_ln={self.fuse_ln}")
        if self.fp8 and (self.n_embd % 16 or self.mlp_hidden % 16):
            raise ValueError(f"config key 'fp8' needs n_embd ({self.n_embd}) and the MLP's hidden size "
                             f"({self.mlp_hidden}) to be multiples of 16 (FP8 GEMMs take them so)")
        if self.fp8_reach not in FP8_REACHES or (self.fp8_reach != "mlp" and not self.fp8):
            raise ValueError(f"config key 'fp8_reach' must be one of {FP8_REACHES}, and 'blocks' needs fp8=True; got "
                             f"{self.fp8_reach!r} with fp8={self.fp8}")
        if self.classifier == "fp8" and (self.n_embd % 16 or self.vocab_size % 16):
            raise ValueError(f"config key 'classifier'='fp8' needs n_embd ({self.n_embd}) and vocab_size "
                             f"({self.vocab_size}) to be multiples of 16 (FP8 GEMMs take them so): use 'fused'")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"config key 'n_embd' ({self.n_embd}) must be divisible by 'n_head' ({self.n_head})")

    @property
    def gated(self):
        return self.activation in GATED_ACTIVATIONS

    @property
    def mlp_hidden(self):
        # Gated MLPs have three matrices instead of two; 8/3·C (rounded up to a multiple of 64) keeps
        # the parameter count close to the plain MLP's 4·C.
        if self.gated:
            return 64 * math.ceil(8 * self.n_embd / 3 / 64)
        return 4 * self.n_embd


class KVCache:
    """Keys and values of the positions seen so far for one attention layer, so generation feeds only new tokens."""

    def __init__(self, max_len):
        self.max_len, self.length, self.k, self.v = max_len, 0, None, None

    def append(self, k, v):
        if self.k is None:  # allocate on first use, in the dtype autocast gives k and v
            B, nh, _, hd = k.shape
            self.k = k.new_empty(B, nh, self.max_len, hd)
            self.v = torch.empty_like(self.k)
        t0, t1 = self.length, self.length + k.size(2)
        if t1 > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {t1} requested")
        self.k[:, :, t0:t1], self.v[:, :, t0:t1] = k, v
        self.length = t1
        return self.k[:, :, :t1], self.v[:, :, :t1]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # fp8_reach="blocks": both projections in FP8 while training, each with its delayed scales (not saved)
        self.fp8 = self.fp8_qkv = self.fp8_linear = None
        if config.fp8_reach == "blocks":
            fused_ops = import_fused_ops(required=True)
            self.fp8 = nn.ModuleList([fused_ops.FP8State(), fused_ops.FP8State()])
            self.fp8_qkv, self.fp8_linear = fused_ops.fp8_linear_qkv, fused_ops.fp8_linear

    def forward(self, x, cache=None, fp8_copies=None):
        B, T, C = x.size()
        copies = fp8_copies or (None, None)  # the two weights' FP8 copies, where GPT.forward made them
        if self.fp8 is None:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:  # q, k and v as three outputs, so that their gradients are cast apart, never concatenated
            q, k, v = self.fp8_qkv(x, self.c_attn.weight, self.c_attn.bias, self.fp8[0], copies[0])
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        mask, causal = None, True
        if cache is not None:
            k, v = cache.append(k, v)
            if k.size(2) != T:  # new queries sit at the end of a longer key sequence: offset the causal mask
                causal = False
                past = k.size(2) - T
                mask = torch.arange(k.size(2), device=x.device) <= past + torch.arange(T, device=x.device)[:, None]
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        if self.fp8 is None:
            y = self.c_proj(y)
        else:
            y = self.fp8_linear(y, self.c_proj.weight, self.c_proj.bias, self.fp8[1], copies[1])
        return self.resid_dropout(y)


class EagerMLP:
    """The reference path, plain PyTorch: c_proj(act(c_fc(norm(x)))). Called like fused_ops' runners, with the
    layers passed in (a runner holds no reference to its module: no cycle keeps a dropped model's weights alive)."""

    def __init__(self, activation):
        self.activation = activation

    def __call__(self, x, c_fc, c_proj, norm=None):
        h = c_fc(x if norm is None else norm(x))
        if self.activation in GATED_ACTIVATIONS:
            return c_proj(GATED_ACTIVATIONS[self.activation](*h.chunk(2, dim=-1)))
        return c_proj(PLAIN_ACTIVATIONS[self.activation](h))


class MLP(nn.Module):
    """c_fc, activation, c_proj. For gated activations c_fc makes [gate | up] in one matmul.

    The one switch between the two paths is here: config.mlp = "eager" runs EagerMLP's PyTorch, "fused" the
    Triton kernels of fused_ops (same parameters, so checkpoints load either way), "auto" the kernels where
    they can run (CUDA tensors, or the CPU interpreter) and the PyTorch elsewhere.
    It takes the block's LayerNorm as an argument and applies it first, so that the fused path can fold the
    normalization into its first matmul (config.fuse_ln) while the parameters stay in Block.ln_2."""

    def __init__(self, config):
        super().__init__()
        self.activation, self.gated = config.activation, config.gated
        hidden = config.mlp_hidden
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden if self.gated else hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.kind, self.fuse_ln = config.mlp, config.fuse_ln
        fused_ops = import_fused_ops(required=self.kind == "fused") if self.kind != "eager" else None
        if fused_ops is None:
            self.kind = "eager"  # (also "auto" without Triton)
        self.fp8 = fused_ops.FP8State() if config.fp8 and fused_ops else None  # its delayed scales (not saved)
        self.fp8_mlp = fused_ops.fp8_mlp if self.fp8 is not None else None
        # The path, picked once: a runner of fused_ops (which owns its CUDA graphs), or EagerMLP.
        eager = EagerMLP(self.activation)
        if self.kind == "eager":
            self.path = eager
        elif self.fp8 is not None:
            self.path = fused_ops.FP8MLP(self.activation, self.fp8)
        elif self.kind == "fused":
            self.path = fused_ops.FusedMLP(self.activation, self.fuse_ln)
        else:  # "auto": the kernels where they can run on x's device, this PyTorch elsewhere
            self.path = fused_ops.AutoMLP(fused_ops.FusedMLP(self.activation, self.fuse_ln), eager)

    def forward(self, x, norm=None, fp8_copies=None):
        if fp8_copies is not None:  # (GPT.forward made the weights' FP8 copies)
            x = x if norm is None else norm(x)
            return self.dropout(self.fp8_mlp(x, self.c_fc, self.c_proj, self.activation, self.fp8, fp8_copies))
        return self.dropout(self.path(x, self.c_fc, self.c_proj, norm))


def import_fused_ops(required):
    """The fused_ops package, imported when first asked for (it imports Triton; model.py runs without it).
    Without Triton: an ImportError if required (mlp="fused"), else None."""
    try:
        import fused_ops
    except ImportError as e:
        if required:
            raise ImportError(f"mlp='fused' needs Triton, which cannot be imported here ({e}): install it, or set "
                              "mlp='eager' or 'auto'") from e
        return None
    return fused_ops


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, fp8_copies=None):
        attn_copies, mlp_copies = fp8_copies or (None, None)
        x = x + self.attn(self.ln_1(x), cache, attn_copies)
        return x + self.mlp(x, norm=self.ln_2, fp8_copies=mlp_copies)

    def fp8_weights(self):
        """(the attention's FP8 weights, the MLP's): the masters whose FP8 copies its layers read (none: ())."""
        attn = (self.attn.c_attn.weight, self.attn.c_proj.weight) if self.attn.fp8 is not None else ()
        return attn, ((self.mlp.c_fc.weight, self.mlp.c_proj.weight) if self.mlp.fp8 is not None else ())


# Peak dense bf16 tensor-core FLOP/s by GPU model (vendor datasheets, without sparsity). Order matters:
# the first key found in the device name wins, so specific names come before general ones.
GPU_PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "GH200": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
}


def gpu_peak_flops(device_name):
    """Peak bf16 FLOP/s for a device name such as 'NVIDIA H100 80GB HBM3', or None if unknown."""
    for key, flops in GPU_PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # the fused classifier or its FP8 form: the loss and its gradients without the logits (only with targets)
        self.fused_classifier = None
        if config.classifier != "eager":
            fused_ops = import_fused_ops(required=True)
            self.fused_classifier = (fused_ops.fp8_linear_cross_entropy if config.classifier == "fp8"
                                     else fused_ops.linear_cross_entropy)
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual projection adds to the stream, so shrink it by sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Parameter count; position embeddings are left out by default (token embeddings are tied to lm_head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, kv_caches=None):
        b, t = idx.size()
        start = kv_caches[0].length if kv_caches else 0
        if start + t > self.config.block_size:
            raise ValueError(f"sequence of length {start + t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        copies = self.fp8_weight_copies()
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_caches[i] if kv_caches else None, copies[i] if copies else None)
        return self.output(x, targets)

    def fp8_weight_copies(self):
        """Training a model compiled whole: every FP8 weight's copies at once, three launches for the model where each
        layer would make its own in several a weight (fused_ops/fp8/weight_copies.py), as one (attention's, MLP's)
        pair a block. None elsewhere: uncompiled, each layer's FP8State keeps them for an optimizer step; with
        compile_regions each block makes its own."""
        if not (self.config.fp8 and torch.is_grad_enabled() and torch.compiler.is_compiling()):
            return None
        weights = [block.fp8_weights() for block in self.transformer.h]
        copies = _model_wide_fp8_copies([w for pair in weights for part in pair for w in part])
        if copies is None:
            return None  # (weights of several dtypes, say: each layer makes its own)
        # (W8, W8ᵀ, 1/scale) a weight: the attention takes one a linear, the MLP all six in one
        copies = iter(copies)
        return [(tuple(next(copies) for _ in attn) or None, tuple(c for _ in mlp for c in next(copies)) or None)
                for attn, mlp in weights]

    def output(self, x, targets=None):
        """The last LayerNorm, then the logits, the loss, or both (a method of its own: compile_regions in
        helpers/runtime.py compiles it as one region)."""
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits are needed
            return self.lm_head(x[:, [-1], :]), None
        if self.fused_classifier is not None:  # training and evaluation: the loss alone, no logits
            return None, self.fused_classifier(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def crop_block_size(self, block_size):
        """Shrink the context length (e.g. to fine-tune GPT-2 on shorter sequences): keep the first
        block_size rows of the position table. Call it before building the optimizer (a new Parameter)."""
        if not (isinstance(block_size, int) and 0 < block_size <= self.config.block_size):
            raise ValueError(f"block_size must be an integer in 1..{self.config.block_size} (the model's context), "
                             f"got {block_size!r}")
        self.config.block_size = block_size
        wpe = self.transformer.wpe
        # A copy, not a view: a view would keep (and a checkpoint would save) the whole original table.
        wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
        wpe.num_embeddings = block_size

    @classmethod
    def from_pretrained(cls, name_or_path, **overrides):
        """A GPT-2 checkpoint in Hugging Face's format as our GPT, on the CPU in fp32 (the files: helpers/hf_gpt2.py).

        name_or_path: gpt2, gpt2-medium, gpt2-large or gpt2-xl (read from the Hugging Face cache, downloaded
        when online), or a folder holding a Hugging Face GPT-2 checkpoint (config.json with model.safetensors
        or pytorch_model.bin), such as save_pretrained writes. The architecture comes from config.json; only
        these may be overridden: mlp ("eager" | "fused" | "auto"), dropout, block_size (crops the position
        table), fuse_ln.
        """
        from helpers import hf_gpt2  # here: only this method and save_pretrained need it (hf_gpt2 never imports model)

        return hf_gpt2.from_pretrained(cls, GPTConfig, name_or_path, **overrides)

    def save_pretrained(self, folder, meta=None):
        """Write this model as a GPT-2 checkpoint that transformers' GPT2LMHeadModel.from_pretrained(folder)
        loads with no custom code: config.json, model.safetensors (biases as zeros where it has none).

        meta, the dataset's metadata (a checkpoint's "meta"), cuts the vocabulary back to the dataset's
        (the padding rows are never a target) and adds its tokenizer: GPT-2's BPE files, or char_vocab.json.
        A gated MLP has no GPT-2 equivalent: a UsageError. An earlier export in folder is replaced whole.
        """
        from helpers import hf_gpt2

        hf_gpt2.save_pretrained(self, folder, meta)

    def precompile_kernels(self, batch_size, autocast_dtype, device, grad_clip=0.0):
        """Start compiling the fused kernels a run of this model launches (its MLP's, FP8 linears', classifier's,
        FusedAdamW's) for batches of batch_size x block_size tokens, in a child process (compile_kernels below), so
        that a cold Triton cache costs the run less start-up (fused_ops/precompile.py). None where nothing is fused
        or not on a GPU."""
        fused = self.transformer.h[0].mlp.kind != "eager" or self.config.classifier != "eager"
        if not fused or not str(device).startswith("cuda"):
            return None
        from fused_ops import precompile
        spec = {"config": {**vars(self.config), "n_layer": 1}, "batch_size": int(batch_size),
                "autocast": None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch."),
                "grad_clip": grad_clip > 0}
        return precompile.start("model:compile_kernels", spec, device)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # Decay matrices and embeddings; never biases or LayerNorm gains (the 1-D parameters).
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # On a GPU, fused_ops' AdamW: one launch a group, at the memory's rate (fused_ops/adamw.py); else PyTorch's.
        fused_ops = import_fused_ops(required=False) if device_type == "cuda" else None
        if (fused_ops is not None and fused_ops.env.ADAMW and len({p.device for p in params}) == 1
                and all(fused_ops.adamw.kernel_can_run(p) for p in params)):
            return fused_ops.FusedAdamW(groups, lr=learning_rate, betas=betas)
        use_fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if use_fused else {}))

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilization against the GPU's peak bf16 rate; None where that peak is unknown (CPU too)."""
        device = self.lm_head.weight.device
        if device.type != "cuda":
            return None
        peak = gpu_peak_flops(torch.cuda.get_device_name(device))
        if peak is None:
            return None
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T  # PaLM appendix B
        return flops_per_token * T * fwdbwd_per_iter / dt / peak

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_kv_cache=True):
        """Continue each row of idx (b, t) by max_new_tokens sampled tokens. Call in eval() mode.

        With the KV cache each step runs the model on one new token. Past block_size every position
        shifts by one per step, so the cache is refilled from the cropped context, exactly as without it.
        """
        caches = None
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            if not use_kv_cache:
                logits, _ = self(context)
            elif caches is None or idx.size(1) > self.config.block_size:
                caches = [KVCache(self.config.block_size) for _ in range(self.config.n_layer)]
                logits, _ = self(context, kv_caches=caches)
            else:
                logits, _ = self(idx[:, -1:], kv_caches=caches)
            logits = logits[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


def compile_kernels(spec, device):
    """The precompile child's work (GPT.precompile_kernels): a one-block copy of the model (every block launches the
    same kernels) on random tokens, through what a run does: an evaluation forward (no_grad), then two training
    steps (an FP8 model calibrates in the first), each with its optimizer's step (grad_scale as the clip hands it)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**spec["config"])).to(device)
    device_type = torch.device(device).type
    optimizer = gpt.configure_optimizers(0.0, 1e-5, (0.9, 0.95), device_type)
    idx = torch.randint(0, gpt.config.vocab_size, (spec["batch_size"], gpt.config.block_size), device=device)
    dtype = getattr(torch, spec["autocast"] or "float32")
    with torch.autocast(device_type, dtype=dtype, enabled=spec["autocast"] is not None):
        with torch.no_grad():
            gpt.eval()(idx, idx)
        gpt.train()
        for _ in range(2):
            gpt(idx, idx)[1].backward()
            if spec["grad_clip"] and getattr(optimizer, "folds_grad_scale", False):
                optimizer.grad_scale = torch.ones((), device=device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if gpt.config.fp8:  # a run compiled whole makes every FP8 weight copy in one operator (GPT.fp8_weight_copies)
        _model_wide_fp8_copies([w for part in gpt.transformer.h[0].fp8_weights() for w in part])
    return gpt


def _model_wide_fp8_copies(weights):
    """fused_ops.fp8_weight_copies(weights), or None where it cannot take them."""
    fused_ops = import_fused_ops(required=True)
    return fused_ops.fp8_weight_copies(weights) if fused_ops.fp8.weight_copies.can_run(weights) else None
