"""Per-layer activations of transformers models (seed 000: forward hooks on every layer,
recursive detach of tuple outputs). BertModel, GPT2Model and LlamaModel cannot be traced by
torch.fx as a whole (they are called with **kwargs); fxdebug.instrument exports each
with torch.export on its first call and captures every layer under its module path
("encoder.layer.1.attention.self.query", "h.1.mlp", "layers.1.self_attn"), and
fxdebug.trace(model, input_ids, frontend="auto") builds one graph of each with torch.export.
Tiny configs, random weights, nothing downloaded. Needs `pip install transformers`.

The factories work on the command line too:
    fxdebug summary examples/transformer_layers.py:gpt2 --depth 2

Run: python examples/transformer_layers.py
"""
import warnings

import torch

import fxdebug

try:
    import transformers
except ModuleNotFoundError:  # the example needs the optional transformers package
    transformers = None


def _transformers():
    """The transformers package, or ModuleNotFoundError saying to install it."""
    if transformers is None:
        raise ModuleNotFoundError(
            f"No module named 'transformers': the factories of {__file__} build transformers "
            f"models (pip install transformers)", name="transformers")
    return transformers


def _ids():
    return torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))


def bert():
    """A 2-layer BertModel with hidden size 32, and its example input."""
    tf = _transformers()
    config = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=64)
    return tf.BertModel(config).eval(), (_ids(),)


def gpt2():
    """A 2-layer GPT2Model (no key/value cache), and its example input."""
    tf = _transformers()
    config = tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                           use_cache=False, bos_token_id=0, eos_token_id=0)
    return tf.GPT2Model(config).eval(), (_ids(),)


def llama():
    """A 2-layer LlamaModel: rotary position embeddings, grouped-query attention, RMSNorm."""
    tf = _transformers()
    config = tf.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                            max_position_embeddings=64, use_cache=False)
    return tf.LlamaModel(config).eval(), (_ids(),)


def main():
    if transformers is None:
        print("ok: skipped, transformers is not installed (pip install transformers)")
        return
    transformers.logging.set_verbosity_error()
    for factory, layer in ((bert, "encoder.layer.1"), (gpt2, "h.1"), (llama, "layers.1")):
        torch.manual_seed(0)
        model, (ids,) = factory()
        with torch.no_grad():
            expected = model(ids).last_hidden_state

        # 1. no example inputs needed: the traceable modules are traced on the first call
        instrumented = fxdebug.instrument(model)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # it lists what ran eagerly; see the report below
            out = instrumented(ids)
        assert torch.equal(out.last_hidden_state, expected)
        rec = fxdebug.records(instrumented)
        layer_keys = [key for key in rec.keys() if key.startswith(layer + ".")]
        assert layer_keys and layer in rec
        report = instrumented.fxdebug_partial
        fronts = ", ".join(f"{p.label or '(root)'} [{p.frontend}]" for p in report.parts)
        print(f"{type(model).__name__}: {len(rec)} tensors captured, parts {fronts}, "
              f"{len(report.eager)} modules eager; {layer}: {len(layer_keys)} keys, "
              f"e.g. {layer_keys[0]} {tuple(rec[layer_keys[0]].shape)}")

        # 2. one graph of the whole model, through torch.export
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # says that fx failed and export was used
            gm = fxdebug.trace(model, ids, frontend="auto")
        assert gm.meta["fxdebug_frontend"] == "export"
        exported = fxdebug.instrument(gm)
        with torch.no_grad():
            assert torch.equal(exported(ids).last_hidden_state, expected)
        same = [key for key in layer_keys if key in fxdebug.records(exported)]
        assert all(torch.equal(fxdebug.records(exported)[key], rec[key]) for key in same)
        print(f"  export front end: {len(same)}/{len(layer_keys)} of those keys, equal values")
    print("ok: BERT, GPT-2 and Llama captured layer by layer under module paths")


if __name__ == "__main__":
    main()
