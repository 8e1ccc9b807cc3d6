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


def refuse_dcp_optimizer_state(caller) -> None:
    """[Note: DCP and the optimizer state] torch DCP's get_state_dict/set_state_dict handle an fsdp_lab model as
    a plain module: its model state dict is right (state_dict() gives full tensors, or DTensors under
    SHARDED_STATE_DICT). Its optimizer state would not be: DCP keys it by model.named_parameters(), and each
    rank's optimizer holds a different shard under the same name there, which DCP saves once as if replicated
    and loads onto every rank. So DCP's optimizer path (the functions that call named_parameters while handling
    an optimizer) is refused here, naming what works."""
    if caller.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict" \
            and "optim" in caller.f_code.co_name:
        raise NotImplementedError(
            "torch.distributed.checkpoint.state_dict cannot save or load an fsdp_lab optimizer: each rank holds a "
            "different shard under one name, which DCP would save once and load onto every rank. Use "
            "FSDP.optim_state_dict(model, optim) / FSDP.optim_state_dict_to_load(model, optim, osd) (keyed by "
            "parameter name, full or sharded: dcp.save takes it), fsdp_lab.checkpoint.save/load for model and "
            "optimizer, or get_model_state_dict(model) / set_model_state_dict(model, ...) for the model alone")
