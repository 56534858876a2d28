"""What the Hugging Face tests share: transformers' logits, jaxpar's, the tolerance between them, a directory's
tensors. Import after `pytest.importorskip("torch")`."""
import os

import jax.numpy as jnp
import numpy as np
import torch
from safetensors.numpy import load_file


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def logits_of(fwd, params, tokens, vocab: int):
    """jaxpar's logits of `tokens`, the padded vocabulary cut to HF's `vocab`."""
    x = fwd.layers(params["blocks"], fwd.embed(params, jnp.asarray(tokens)))
    return np.asarray(fwd.logits(params, x))[..., :vocab]


def close(got, want):
    """Within 1e-4 of transformers' (fp32, max abs over the logits' max abs)."""
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-4, err


def hf_tensors(directory):
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out
