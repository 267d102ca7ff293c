"""Real model families, tiny and random, under the parallelism configurations users apply.

    model, inputs = make("llama")                   # a tiny LlamaForCausalLM, its input ids
    model = configure(model, "llama", "fsdp")       # fully_shard on each block, then the root
    why = unsupported("gpt2", "tp")                 # "" where the pair applies, else why not

Families (``FAMILIES``): Hugging Face ``llama``, ``gpt2``, ``qwen2`` (2 layers, hidden
64, eager attention, no cache), timm ``mixer`` (MlpMixer, 2 blocks, dim 64) and ``vit``
(2 blocks, dim 64), torchvision ``resnet18`` (32x32 input). Weights are random, seeded:
``make(family)`` gives the same model on every rank and every call (timm's heads drawn
from a normal distribution: timm starts them at zero).

Configurations (``CONFIGS``), each applied in place on every rank of the default group:

- ``fsdp`` / ``fsdp_bf16``: ``fully_shard`` on each block, then on the root (whose
  own parameters, embeddings and heads, the root's hook gathers), fp32 or with a bf16
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``;
- ``tp``: a hand-written plan, ``ColwiseParallel`` on the first linear of each MLP (and
  the q/k/v projections of HF attention), ``RowwiseParallel`` on the second (``o_proj``);
- ``tp_hf``: the plan transformers ships (``config.base_model_tp_plan``: ``colwise`` and
  ``rowwise`` mapped to torch's styles), applied with ``parallelize_module`` on the base model;
- ``fsdp_tp``: ``tp`` on the ``tp`` dimension of a 2x2 mesh, ``fully_shard`` on ``dp``;
- ``hsdp``: ``fully_shard`` on a (replicate, shard) mesh of world/2 x 2.

Importable without transformers, timm or torchvision: :func:`make` skips the test
(``pytest.importorskip``) where its library is missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

__all__ = ["FAMILIES", "CONFIGS", "make", "blocks", "tp_plan", "unsupported", "configure",
           "mesh_for", "loss_of", "output_tensor"]

FAMILIES = ("llama", "gpt2", "qwen2", "mixer", "vit", "resnet18")
CONFIGS = ("fsdp", "fsdp_bf16", "tp", "tp_hf", "fsdp_tp", "hsdp")
HF = ("llama", "gpt2", "qwen2")
VOCAB, SEQ, BATCH = 96, 8, 2


def _hf_config(transformers, family: str):
    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation="eager",
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, **common)


def make(family: str, seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    """``(model, inputs)``: the family's tiny model (eval mode, seeded weights) and one input batch."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {FAMILIES}")
    generator = torch.Generator().manual_seed(1000 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        if family in HF:
            transformers = pytest.importorskip("transformers")
            config = _hf_config(transformers, family)
            cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
                   "qwen2": transformers.Qwen2ForCausalLM}[family]
            model = cls(config)
            inputs: tuple = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),)
        elif family in ("mixer", "vit"):
            timm = pytest.importorskip("timm")
            if family == "mixer":
                model = timm.models.mlp_mixer.MlpMixer(num_classes=10, img_size=32, patch_size=8,
                                                       num_blocks=2, embed_dim=64)
            else:
                model = timm.models.vision_transformer.VisionTransformer(
                    img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=2,
                    num_heads=4, mlp_ratio=2.0)
            # timm starts the head at zero: the logits would not depend on anything before it
            torch.nn.init.normal_(model.head.weight, std=0.2)
            inputs = (torch.randn(BATCH, 3, 32, 32, generator=generator),)
        else:
            torchvision = pytest.importorskip("torchvision")
            model = torchvision.models.resnet18(num_classes=10)
            inputs = (torch.randn(BATCH, 3, 32, 32, generator=generator),)
    return model.eval(), inputs


def blocks(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    """The repeated blocks ``fully_shard`` is applied to before the root."""
    if family in ("llama", "qwen2"):
        return list(model.model.layers)
    if family == "gpt2":
        return list(model.transformer.h)
    if family in ("mixer", "vit"):
        return list(model.blocks)
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def _base(model: torch.nn.Module, family: str) -> tuple[torch.nn.Module, str]:
    """The module a plan's keys are relative to, and its path."""
    if family in ("llama", "qwen2"):
        return model.model, "model"
    return model, ""


def tp_plan(family: str, which: str = "hand") -> dict | None:
    """``{module path (globs allowed): ParallelStyle}`` relative to :func:`_base`, or None.

    ``which="hand"``: written here; ``"hf"``: transformers' ``base_model_tp_plan``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if which == "hf":
        if family not in HF:
            return None
        transformers = pytest.importorskip("transformers")
        shipped = _hf_config(transformers, family).base_model_tp_plan
        if not shipped:
            return None
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return {path: styles[style]() for path, style in shipped.items()}
    if family in ("llama", "qwen2"):
        return {"layers.*.self_attn.q_proj": ColwiseParallel(),
                "layers.*.self_attn.k_proj": ColwiseParallel(),
                "layers.*.self_attn.v_proj": ColwiseParallel(),
                "layers.*.self_attn.o_proj": RowwiseParallel(),
                "layers.*.mlp.gate_proj": ColwiseParallel(),
                "layers.*.mlp.up_proj": ColwiseParallel(),
                "layers.*.mlp.down_proj": RowwiseParallel()}
    if family == "mixer":
        return {"blocks.*.mlp_channels.fc1": ColwiseParallel(),
                "blocks.*.mlp_channels.fc2": RowwiseParallel()}
    if family == "vit":
        return {"blocks.*.mlp.fc1": ColwiseParallel(), "blocks.*.mlp.fc2": RowwiseParallel()}
    return None  # gpt2: Conv1D projections, resnet18: convolutions (no torch style for them)


def unsupported(family: str, config: str, world: int = 2) -> str:
    """Why ``config`` does not apply to ``family`` on ``world`` ranks, or ``""``."""
    if config not in CONFIGS:
        raise ValueError(f"config {config!r}: one of {CONFIGS}")
    if config in ("tp", "fsdp_tp") and tp_plan(family) is None:
        return f"{family}: torch's ColwiseParallel/RowwiseParallel shard nn.Linear only"
    if config == "tp_hf" and tp_plan(family, "hf") is None:
        return f"{family}: transformers ships no base_model_tp_plan for it"
    if config == "fsdp_bf16" and family == "resnet18":
        return ("resnet18: BatchNorm's float32 running statistics meet bf16 parameters "
                "(F.batch_norm refuses mixed dtypes)")
    if config in ("fsdp_tp", "hsdp") and (world % 2 or world < 4):
        return f"{config} needs a 2-D mesh: 4 ranks (world={world})"
    return ""


def mesh_for(config: str, world: int):
    """The device mesh ``config`` uses on ``world`` CPU ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    if config == "fsdp_tp":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    if config == "hsdp":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _fully_shard(model, family, mesh, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    options = {"mesh": mesh}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in blocks(model, family):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def configure(model: torch.nn.Module, family: str, config: str, world: int | None = None,
              mesh=None, plan: dict | None = None) -> torch.nn.Module:
    """Apply ``config`` to ``model`` (in place, every rank of the default group calls it).

    ``mesh``: the one :func:`mesh_for` gives, else made here. ``plan``: the TP plan to apply
    instead of :func:`tp_plan`'s (a planted bug). Raises ValueError where :func:`unsupported`
    says the pair does not apply.
    """
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module
    world = dist.get_world_size() if world is None else world
    why = unsupported(family, config, world)
    if why:
        raise ValueError(why)
    mesh = mesh_for(config, world) if mesh is None else mesh
    if config in ("fsdp", "fsdp_bf16", "hsdp"):
        return _fully_shard(model, family, mesh, bf16=config == "fsdp_bf16")
    base, _ = _base(model, family)
    tp_mesh = mesh["tp"] if config == "fsdp_tp" else mesh
    if plan is None:
        plan = tp_plan(family, "hf" if config == "tp_hf" else "hand")
    parallelize_module(base, tp_mesh, plan)
    if config == "fsdp_tp":
        _fully_shard(model, family, mesh["dp"])
    return model


def output_tensor(output) -> torch.Tensor:
    """The model's main output tensor (HF: ``logits``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:  # a ModelOutput (or its fields)
        return output["logits"]
    return output[0]


def loss_of(output) -> torch.Tensor:
    """A scalar to call ``backward()`` on: the mean square of the main output."""
    out = output_tensor(output)
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return out.float().pow(2).mean()
