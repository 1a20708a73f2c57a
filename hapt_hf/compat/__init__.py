"""The one place hapt_hf reaches into private torch, transformers and Trainer APIs.

Each function names the versions it was tested on; pyproject.toml pins the ranges the tests
ran on. A release that moves one of these internals is then fixed here, once. The modules
import torch or transformers, and nothing of hapt_hf but the error classes and core facts:

* :mod:`hapt_hf.compat.torch_api`: tensor factories, dispatch modes, op schemas, storages;
* :mod:`hapt_hf.compat.transformers_api`: mask builders and the causal-LM loss;
* :mod:`hapt_hf.compat.moe_autocast`: DBRX's experts run under autocast as transformers' other MoEs;
* :mod:`hapt_hf.compat.trainer_api`: ``Trainer``'s private hooks and state.
"""
