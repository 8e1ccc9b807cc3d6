"""What of torch FSDP1's public API fsdp_lab does not have, and the message that says so.

Each public method of torch's FullyShardedDataParallel is either here, with what to use instead (calling it
raises NotImplementedError naming it), or on fsdp_lab.FSDP with torch's exact signature:
tests/test_torch_signatures.py checks both against torch itself, so a torch method added later fails the test
until it is decided.
"""
from __future__ import annotations

_CHECKPOINT = ("torch deprecated it for FSDP.optim_state_dict(model, optim) and FSDP.optim_state_dict_to_load(model, "
               "optim, osd), which fsdp_lab has; fsdp_lab.checkpoint.save/load also keep the sharded optimizer")
NOT_PROVIDED = {
    "full_optim_state_dict": _CHECKPOINT + " state",
    "sharded_optim_state_dict": _CHECKPOINT + " state",
    "shard_full_optim_state_dict": _CHECKPOINT + " state",
    "scatter_full_optim_state_dict": _CHECKPOINT + " state",
    "flatten_sharded_optim_state_dict": _CHECKPOINT + " state",
    "rekey_optim_state_dict": "FSDP.optim_state_dict(model, optim) is keyed by parameter name already, and "
                              "FSDP.optim_state_dict_to_load(model, optim, osd) turns it into the optimizer's ids",
    "register_comm_hook": "the collectives are fixed (fsdp_lab/runtime/core/collectives.py); reduce_dtype sets the "
                          "gradient reduction's dtype",
}


def not_provided_message(name: str) -> str:
    return f"FSDP.{name} is not provided by fsdp_lab: {NOT_PROVIDED[name]}"


def not_provided(name: str):
    def refuse(*_args, **_kwargs):
        raise NotImplementedError(not_provided_message(name))
    refuse.__name__ = refuse.__qualname__ = name
    return staticmethod(refuse)


DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"  # the module whose calls both fsdp1 seams recognise


def refuse_dcp_optimizer_state(caller) -> None:
    """Called by FSDP.named_parameters with its caller's frame: refuse torch DCP's state_dict functions when they
    were handed an optimizer.

    [Note: DCP and the optimizer state] torch 2.13's torch/distributed/checkpoint/state_dict.py can give and load
    FSDP1's optimizer state only for torch's own FSDP. _verify_options detects FSDP1 by
    `FSDP.fsdp_modules(model)`, which finds torch's FullyShardedDataParallel instances (its _FSDPState) and none of
    ours; for those it calls torch's FSDP.optim_state_dict / FSDP.optim_state_dict_to_load, which read torch's
    internal FlatParamHandle (torch/distributed/fsdp/_optim_utils.py). Everything else takes its generic branch:
    _get_optim_state_dict keys the optimizer state by tensor identity, one key per optimizer parameter, named by
    model.named_parameters(). Here (use_orig_params=False) an optimizer parameter is a unit's flat shard, so the
    keys would be the flat parameters' names, never torch's per-original-parameter ones, and each rank's different
    shard would sit under the same key, which dcp.save writes once as if replicated. Loading goes the same way:
    _split_optim_state_dict looks each optimizer parameter up by its one name and, strict, fails on a checkpoint
    keyed by original names ("Missing optimizer state for parameter ..."). No setting of ours can change either
    path, so every DCP call given an optimizer (get_state_dict(model, optim), set_state_dict, get/
    set_optimizer_state_dict) is refused here, at its first step: all of them pass through _verify_options, whose
    `optims` says whether an optimizer was given, and it walks model.named_parameters() before anything is
    gathered or loaded. The message names what works. The model alone is fine: get_model_state_dict gives
    DTensor pieces as torch's FSDP1 gives ShardedTensor ([Note: DCP's get_model_state_dict] in state_dict.py)."""
    frame = caller
    while frame is not None and frame.f_globals.get("__name__") == DCP_STATE_DICT:
        if frame.f_code.co_name == "_verify_options" and frame.f_locals.get("optims"):
            raise NotImplementedError(
                "torch.distributed.checkpoint.state_dict cannot save or load an fsdp_lab FSDP optimizer: torch's "
                "DCP gives FSDP1 optimizer state by original parameter name only for torch's own FSDP instances; "
                "for this model it would key the state by each unit's flat shard, a different tensor on each rank "
                "under one name. Use FSDP.optim_state_dict(model, optim) / FSDP.optim_state_dict_to_load(model, "
                "optim, osd) (keyed by parameter name, full or sharded: dcp.save takes it), "
                "fsdp_lab.checkpoint.save/load for model and optimizer, or get_model_state_dict(model) / "
                "set_model_state_dict(model, ...) for the model alone")
        frame = frame.f_back
