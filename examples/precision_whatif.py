"""Which layers of a model can train in bfloat16 or float8? Measured, not by rule of thumb.

People moving a model to bf16 or fp8 keep "the first and last layers" in high precision
because a tweet said so. ``fxdebug.precision_sensitivity`` runs one training step with each
matrix product alone rounded to bfloat16 and to float8 (e4m3, torchao's amax scaling,
forward and backward) and measures the loss and the parameter gradients against a float64
run of the same step. ``report.choose(budget)`` then finds the largest set that stays within
a budget (here: no worse than twice the loss error bf16 autocast gives), measuring the
combined set rather than adding up estimates, and hands back a ``module_filter_fn`` for
``torchao.float8.convert_to_float8_training``.

Two models, random weights, on the CPU: a tiny GPT-2 (transformers, traced with
torch.export; its attention and MLP projections are transformers' Conv1D, which torchao
does not convert, so only ``lm_head`` can reach the filter) and torchvision's resnet18 on
64x64 images (float8 only, and only its last stage and the classifier, to keep the
example short: ``select=`` takes keys, globs and module classes).

Run: python examples/precision_whatif.py
"""
import time

import torch
import torch.nn.functional as F
import torchvision

import fxdebug

try:
    import transformers
except ModuleNotFoundError:  # the GPT-2 half needs the optional transformers package
    transformers = None


def gpt2():
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=16, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)  # random weights
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))

    def next_token_loss(out):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return model, (ids,), next_token_loss, ("bfloat16", "float8_e4m3fn"), None


def resnet18():
    model = torchvision.models.resnet18(num_classes=10)
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([3, 7])
    return (model, (images,), lambda out: F.cross_entropy(out, labels), ("float8_e4m3fn",),
            ["layer4", "fc"])


def main():
    torch.manual_seed(0)
    factories = [resnet18] if transformers is None else [gpt2, resnet18]
    for factory in factories:
        started = time.perf_counter()
        model, inputs, loss, dtypes, select = factory()
        report = fxdebug.precision_sensitivity(model, *inputs, loss=loss, dtypes=dtypes,
                                               select=select)
        print(f"== {factory.__name__}")
        print(report.table())
        choice = report.choose(budget=2, relative_to="autocast", dtype="float8_e4m3fn")
        print()
        print(choice.table())
        print(f"torchao.float8.convert_to_float8_training(model, module_filter_fn="
              f"{choice.module_filter_fn})")
        assert choice.ok and choice.measured["loss"] <= 2 * report.autocast["loss"]
        print(f"({time.perf_counter() - started:.1f} s)\n")
    if transformers is None:
        print("(GPT-2 skipped: pip install transformers)")
    print("ok: the chosen set's loss error, measured against float64, is within the budget")


if __name__ == "__main__":
    main()
