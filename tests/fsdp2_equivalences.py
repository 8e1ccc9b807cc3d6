"""Every notebook cell that sets an FSDP2 line beside an FSDP1 line, with what it claims the two share and the
tests in tests/test_fsdp2_equivalence.py that run both lines (torch's and fsdp_lab's) and check it.

`fsdp1` and `fsdp2` are snippets of the cell's own text (whitespace aside): when the cell's lines change, the
hygiene test sends the reader here. `same` names the properties the cell claims equal; `differs` those it says
have no FSDP2 equivalent. tests/test_fsdp2_equivalence_hygiene.py fails on a cell that shows both lines without an
entry, on an entry whose cell is gone, and on a check that is not a test.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Equivalence:
    notebook: str  # file name under notebooks/
    cell: str  # the cell's nbformat id
    fsdp1: str
    fsdp2: str
    same: tuple  # properties claimed equal
    checks: tuple  # test functions in tests/test_fsdp2_equivalence.py
    differs: tuple = field(default=())  # what the cell says FSDP2 has no equivalent for


_WRAP = ("units gathered in forward", "resharded after forward (root kept, blocks freed)",
         "backward prefetch order")
_WRAP_CHECKS = ("test_wrap_policy_and_fully_shard_loop_run_the_same_lifecycle", "test_fsdp_lab_logs_match_torch")

EQUIVALENCES = (
    Equivalence("01-core-idea.ipynb", "legacy-01", "FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}))",
                "fully_shard(block)", _WRAP, _WRAP_CHECKS),
    Equivalence("02-sharding.ipynb", "legacy-02",
                'FSDP(build_gpt("tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}))', "fully_shard(block)",
                _WRAP, _WRAP_CHECKS),
    Equivalence("03-lifecycle.ipynb", "legacy-03", "backward_prefetch=None", "fully_shard(block)",
                ("units gathered in forward", "units re-gathered in backward"),
                ("test_backward_prefetch_none_has_no_fully_shard_equivalent", "test_fsdp_lab_logs_match_torch"),
                differs=("backward prefetch (set_modules_to_backward_prefetch([]) restores the default)",)),
    Equivalence("04-mixed-precision.ipynb", "legacy-04", "mixed_precision=policy",
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
                ("gathered parameters in bf16", "output in bf16", "fp32 shards and gradients", "fp32 reduction",
                 "lifecycle"),
                ("test_mixed_precision_and_its_policy_cast_the_same", "test_fsdp_lab_logs_match_torch")),
    Equivalence("04-mixed-precision.ipynb", "939481c3", "ShardedGradScaler", "torch.amp.GradScaler",
                ("an inf on one rank skips the step on every rank",),
                ("test_sharded_grad_scaler_and_plain_grad_scaler_skip_together",)),
    Equivalence("05-zero.ipynb", "legacy-05", "sharding_strategy=ShardingStrategy.SHARD_GRAD_OP",
                "fully_shard(block, reshard_after_forward=False)",
                ("blocks stay gathered from forward to backward", "no re-gather in backward"),
                ("test_shard_grad_op_is_reshard_after_forward_false", "test_no_shard_has_no_fully_shard_form"),
                differs=("NO_SHARD",)),
    Equivalence("05-zero.ipynb", "accum-05-00", "with model.no_sync():", "set_requires_gradient_sync(False)",
                ("no reduction while accumulating", "two gathers per block per micro-batch",
                 "the accumulated gradient"),
                ("test_no_sync_and_requires_gradient_sync_accumulate_the_same",
                 "test_reshard_after_backward_false_keeps_blocks_gathered_between_micro_batches")),
    Equivalence("05-zero.ipynb", "accum-05-02", "no_sync()", "set_requires_gradient_sync(False)",
                ("no reduction while accumulating", "the accumulated gradient"),
                ("test_no_sync_and_requires_gradient_sync_accumulate_the_same",)),
    Equivalence("06-engineering.ipynb", "legacy-06", "transformer_auto_wrap_policy, transformer_layer_cls={Block}",
                "fully_shard(block)", _WRAP, _WRAP_CHECKS),
    Equivalence("06a-fsdp2.ipynb", "fsdp2-12", "FSDP1's default `BACKWARD_PRE`", "what FSDP2 always does",
                ("the next block re-gathered before this one's backward is done",),
                ("test_wrap_policy_and_fully_shard_loop_run_the_same_lifecycle",)),
    Equivalence("06a-fsdp2.ipynb", "fsdp2-15", "StateDictType.SHARDED_STATE_DICT", "get_model_state_dict",
                ("model's keys", "global shapes", "this rank's rows"),
                ("test_sharded_state_dict_and_fully_shard_state_dict_hold_the_same_rows",
                 "test_get_model_state_dict_on_both_front_ends"),
                differs=("FSDP1 all-gathers for a sharded state dict; FSDP2 communicates nothing",
                         "torch's FSDP1 values are ShardedTensor, FSDP2's DTensor")),
    Equivalence("06a-fsdp2.ipynb", "fsdp2-17", "for both of torch's APIs (for FSDP1 as `ShardedTensor`",
                "get_model_state_dict",
                ("model's keys", "global shapes", "this rank's rows"),
                ("test_get_model_state_dict_on_both_front_ends",)),
    Equivalence("06a-fsdp2.ipynb", "fsdp2-19", "auto_wrap_policy=ModuleWrapPolicy({Block})",
                "`fully_shard(block)` per block, then `fully_shard(model)`",
                ("lifecycle", "mixed precision", "global gradient norm", "no reduction while accumulating",
                 "sharded state dict", "the model stays the same object, an FSDPModule"),
                ("test_wrap_policy_and_fully_shard_loop_run_the_same_lifecycle",
                 "test_fully_shard_keeps_the_model_object_and_makes_it_an_fsdp_module",
                 "test_mixed_precision_and_its_policy_cast_the_same",
                 "test_clip_grad_norm_method_and_torch_function_agree",
                 "test_no_sync_and_requires_gradient_sync_accumulate_the_same",
                 "test_sharded_state_dict_and_fully_shard_state_dict_hold_the_same_rows",
                 "test_summon_full_params_has_no_single_fully_shard_equivalent"),
                differs=("summon_full_params: full_tensor() is a copy; unshard() is per module, in param_dtype",)),
    Equivalence("06b-beyond-one-node.ipynb", "beyond-meta", "param_init_fn=init_weights",
                "`fully_shard(block)` on the meta model, then `model.to_empty(device=...)`",
                ("per-rank peak at shards plus one unit", "below the peak of a model built first"),
                ("test_meta_init_param_init_fn_and_fully_shard_to_empty_peak_at_shards_plus_one_unit",)),
    Equivalence("06b-beyond-one-node.ipynb", "beyond-hsdp", "`HYBRID_SHARD` with `device_mesh=init_device_mesh",
                'fully_shard(block, mesh=init_device_mesh("cpu", (2, 2)',
                ("shard group: the node's ranks", "replicate group: across nodes", "the losses"),
                ("test_hybrid_shard_and_fully_shard_on_a_2d_mesh_shard_in_the_node_and_train_the_same",)),
    Equivalence("06b-beyond-one-node.ipynb", "beyond-offload", "cpu_offload=CPUOffload(offload_params=True)",
                "offload_policy=CPUOffloadPolicy()",
                ("parameters, gradients and optimizer state on the host", "the loss"),
                ("test_cpu_offload_and_its_policy_keep_the_state_on_the_host",)),
    Equivalence("07-when-to-use.ipynb", "91c9dfb4", "CPUOffload(offload_params=True)",
                "offload_policy=CPUOffloadPolicy()",
                ("parameters, gradients and optimizer state on the host", "the loss"),
                ("test_cpu_offload_and_its_policy_keep_the_state_on_the_host",)),
    Equivalence("07-when-to-use.ipynb", "legacy-07", "FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}))",
                "fully_shard(block)", _WRAP, _WRAP_CHECKS),
    Equivalence("08-python-demo.ipynb", "legacy-08", "FSDP(layers, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))",
                "for layer in layers.modules():",
                ("units: every nn.Linear at any depth", "lifecycle"),
                ("test_linear_policy_and_modules_loop_shard_every_linear_at_any_depth",)),
    Equivalence("09-misconceptions.ipynb", "legacy-09", "sharding_strategy=ShardingStrategy.FULL_SHARD",
                "fully_shard(block)", _WRAP, _WRAP_CHECKS + ("test_shard_grad_op_is_reshard_after_forward_false",)),
    Equivalence("10-interview.ipynb", "legacy-10", "sharding_strategy=strategy",
                "reshard_after_forward=(strategy is ShardingStrategy.FULL_SHARD)",
                ("FULL_SHARD: blocks resharded after forward", "SHARD_GRAD_OP: blocks kept",
                 "the root kept gathered (reshard_after_forward=None)"),
                ("test_shard_grad_op_is_reshard_after_forward_false", "test_no_shard_has_no_fully_shard_form"),
                differs=("NO_SHARD",)),
)
