"""Rank functions for the Hugging Face test: a small Llama with sizes that divide by nothing in particular, wrapped
as HF recipes wrap it (transformer_auto_wrap_policy on the decoder layer, use_orig_params, optimizer groups by
name), trained with an evaluation forward after each step. Imports transformers: only the test that found it
installed spawns these."""
from __future__ import annotations

import functools

import torch

from fsdp_lab import FSDP
from fsdp_lab.training.models import rank_slice
from fsdp_lab.wrap import transformer_auto_wrap_policy

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 6, 9, 53


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=37, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _groups(model):
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "norm" in n or n.endswith("bias")]
    decay = [p for n, p in named if not ("norm" in n or n.endswith("bias"))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def train(rank: int, world_size: int, strategy: str | None, gradient_checkpointing: bool):
    """strategy None: one process on the whole batch. Returns the final state dict (original names)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_llama()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if strategy is not None:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, use_orig_params=True)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = rank_slice(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g), rank, world_size)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        if strategy is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_fully_shard(rank: int, world_size: int, lib: str):
    """The same Llama with tied input and output embeddings, as an FSDP2 recipe shards it: fully_shard on each
    decoder layer, then on the model; `lib` is "torch", "fsdp_lab" or "plain" (one process, whole batch).
    Returns the final full parameters under their plain names."""
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=37, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if lib != "plain":
        if lib == "torch":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_lab import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = rank_slice(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g), rank, world_size)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
