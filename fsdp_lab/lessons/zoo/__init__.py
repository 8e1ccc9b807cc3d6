"""The bug zoo (chapter 09a): failures FSDP users really report, each one reproduced on live ranks in seconds.

Every entry has a broken version that shows the symptom, a tool that diagnoses it (the collective log for a hang,
memory_report for bytes, a gradient or parameter check against one process), the fix the learner types, and a
check in .checks that confirms it. ENTRIES names the public report each one comes from.

- .common   the tiny model, its batches, the one-process reference, a short-timeout group for a hang
- .hangs    collectives that only some ranks enter: uneven batches, a save on rank 0 only, an unused expert
- .numbers  wrong numbers that train anyway: local-shard grad norms, a summed loss, a different init per rank,
            an optimizer built before wrapping, buffers cast by mixed precision, a sampler without set_epoch
- .memory   bytes measured: full state dicts on every rank, no_sync accumulation, wrapping only the root,
            parameters read outside forward
- .units    which parameters share a unit: a weight tied across two units, frozen and trainable in one unit
            (torch's FSDP1 beside fsdp_lab's)
- .checks   the "Your turn" checks: each runs the learner's fix on the ranks and answers ok / not yet
"""
from __future__ import annotations

# entry -> (what users see, the public report: repository#number and its address), in the chapter's order
ENTRIES = {
    "uneven_batches": ("a hang at the end of an epoch", "pytorch/torchtitan#1618",
                       "https://github.com/pytorch/torchtitan/issues/1618"),
    "save_on_rank_0": ("a hang while saving", "pytorch/pytorch#143536",
                       "https://github.com/pytorch/pytorch/issues/143536"),
    "unused_expert": ("an MoE model that hangs after a few steps", "pytorch/pytorch#126616",
                      "https://github.com/pytorch/pytorch/issues/126616"),
    "local_grad_norm": ("a gradient norm that differs by rank", "pytorch/torchtitan#766",
                        "https://github.com/pytorch/torchtitan/issues/766"),
    "summed_loss": ("gradients world_size times too large", "neuralmagic/sparseml#135",
                    "https://github.com/neuralmagic/sparseml/pull/135"),
    "different_init": ("N different models trained with one gradient", "pytorch/torchtitan#166",
                       "https://github.com/pytorch/torchtitan/issues/166"),
    "optimizer_before_wrap": ("training that stalls: the optimizer steps nothing", "huggingface/accelerate#3256",
                              "https://github.com/huggingface/accelerate/issues/3256"),
    "buffer_dtype": ("buffers kept in low precision", "facebookresearch/fairscale#442",
                     "https://github.com/facebookresearch/fairscale/issues/442"),
    "sampler_epoch": ("the same data order every epoch", "pytorch/pytorch#31771",
                      "https://github.com/pytorch/pytorch/issues/31771"),
    "full_state_dict_everywhere": ("host OOM while saving", "facebookresearch/fairscale#844",
                                   "https://github.com/facebookresearch/fairscale/issues/844"),
    "no_sync_memory": ("gradient accumulation runs out of memory", "facebookresearch/fairseq#3727",
                       "https://github.com/facebookresearch/fairseq/pull/3727"),
    "root_only": ("no memory saved: FSDP does not wrap submodules by default", "pytorch/pytorch#73809",
                  "https://github.com/pytorch/pytorch/issues/73809"),
    "outside_forward": ("a shape mismatch in generate()", "huggingface/accelerate#3005",
                        "https://github.com/huggingface/accelerate/issues/3005"),
    "tied_across_units": ("an embedding and an LM head silently untied", "facebookresearch/lingua#75",
                          "https://github.com/facebookresearch/lingua/pull/75"),
    "frozen_in_one_unit": ("LoRA fails: FlatParameter requires uniform requires_grad", "pytorch/pytorch#100945",
                           "https://github.com/pytorch/pytorch/issues/100945"),
}


def cite(entry: str) -> str:
    """`reported as pytorch/torchtitan#1618 (a hang at the end of an epoch): https://...`."""
    what, ref, url = ENTRIES[entry]
    return f"reported as {ref} ({what}): {url}"
