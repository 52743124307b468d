"""A benchmark variant's name, read: which MLP, classifier, kernel family and compile setting it runs (bench.py's
--mlps and --compile, the lab probes' variant names).

    "fp8blocks+cls8"        the FP8 MLP and attention projections, the FP8 classifier
    "fused+cls+portable"    the fused MLP and classifier on the portable kernels (FUSED_OPS_PINGPONG=0)
    "eager@True"            under its own compile setting (torch.compile's default mode), whatever --compile says
"""

MLPS = ("eager", "fused", "auto", "fp8", "fp8blocks", "torchao")
# The kernel families a fused path can run, as the fused_ops.env switches that select them; "fused" is the GPU's own
# choice (on Hopper the ping-pong kernels), "portable" the Triton kernels, "pointer" their pointer main loop.
FAMILIES = {"fused": {}, "portable": dict(PINGPONG=False), "pointer": dict(PINGPONG=False, TMA_MODE="0")}


def kernel_family(mlp):
    """(the variant without its kernel family, the fused_ops.env switches that select the family): "fused+cls+portable"
    is ("fused+cls", {"PINGPONG": False})."""
    for name in ("portable", "pointer"):
        if mlp.endswith("+" + name):
            return mlp[: -len(name) - 1], FAMILIES[name]
    return mlp, {}


def compile_setting(text):
    """--compile's entries: "False" / "True" as booleans, anything else a torch.compile mode."""
    return {"False": False, "True": True}.get(text, text)


def variant_list(mlps, compiles):
    """(mlp, compile setting) of each variant: every --mlps entry under every --compile setting, except an entry that
    names its own after "@" (eager@True, fp8blocks+cls8@reduce-overhead), which runs under that one only."""
    variants = []
    for i, c in enumerate(compiles.split(",")):
        for m in mlps.split(","):
            mlp, _, own = m.partition("@")
            if not own or i == 0:
                variants.append((mlp, compile_setting(own or c)))
    return variants


def parse_variant(text):
    """A lab probe's variant name ("fused", "fp8+compile", "fused+cls+reduce-overhead") as (mlp, compile setting)."""
    cls = "+cls8" if "+cls8" in text else "+cls" if "+cls" in text else ""
    mlp, _, mode = text.replace(cls, "").partition("+")
    return mlp + cls, compile_setting({"": "False", "compile": "True"}.get(mode, mode))
