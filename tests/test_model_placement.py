"""Where the AR expert lives: held once beside the engine, streamed to the NAR prefill, moved only by its owner."""
import threading

import pytest
import torch

from yue2_vllm.memory import ar_host_bytes
from yue2_vllm.model.loader import load_model
from yue2_vllm.model.modeling import CachedNAR, ar_streamed_shapes
from yue2_vllm.model.placement import ARPlacement, placement_of, weight_homes
from yue2_vllm.testing import TINY_CONFIG


def where(model):
    """`{device type: bytes}` of the model's tensors."""
    found = {}
    for tensor in (*model.parameters(), *model.buffers()):
        found[tensor.device.type] = found.get(tensor.device.type, 0) + tensor.numel() * tensor.element_size()
    return found


@pytest.fixture
def beside_engine(tiny_model_dir):
    """The tiny MoT loaded as beside the engine on an accelerator; `meta` stands in for the card (nothing
    here has a GPU): the AR expert goes to host memory, everything else to the device."""
    return load_model(tiny_model_dir, device="meta", ar_on_device=False)


def test_the_ar_expert_is_held_once_in_host_memory_and_the_rest_on_the_device(beside_engine, tiny_model_dir):
    model = beside_engine
    host = {name for name, home in weight_homes(model.config, False).items() if home == "host"}
    assert host == set(ar_streamed_shapes(model.config)) and "model.norm.weight" not in host
    for name, tensor in model.named_parameters():
        assert tensor.device.type == ("cpu" if name in host else "meta"), name
    counted = where(model)
    assert counted["cpu"] == ar_host_bytes(TINY_CONFIG) and model.device.type == "meta"
    assert placement_of(model).home == "host" and placement_of(model).moves == []
    # On the CPU (and for a pipeline that runs the AR half itself) nothing is split.
    resident = load_model(tiny_model_dir, ar_on_device=False)
    assert set(where(resident)) == {"cpu"} and placement_of(resident).home == "device"


def test_moves_happen_only_under_the_owner_never_under_a_holder_and_are_counted(beside_engine):
    model = beside_engine
    owner = placement_of(model)
    host_tensors = {name: t for name, t in model.named_parameters() if t.device.type == "cpu"}
    with owner.hold("any", "nar prefix prefill") as place:  # the prefill reads them where they are
        assert place == "host" and owner.moves == []
    prefill_holds, torch_song_moved = threading.Event(), threading.Event()
    release_prefill = threading.Event()

    def prefill():
        with owner.hold("any", "nar prefix prefill"):
            prefill_holds.set()
            release_prefill.wait(10)

    def torch_song():
        with owner.hold("device", "semantic phase (torch backend)") as place:
            assert place == "device"
            assert all(t.device.type == "meta" for name, t in model.named_parameters())
            torch_song_moved.set()

    threads = [threading.Thread(target=prefill)]
    threads[0].start()
    assert prefill_holds.wait(10)
    threads.append(threading.Thread(target=torch_song))
    threads[1].start()
    assert not torch_song_moved.wait(0.3) and owner.moves == []  # no move while the prefill holds the weights
    release_prefill.set()
    for thread in threads:
        thread.join(10)
    assert torch_song_moved.is_set()
    # One move onto the device for the torch song and one back home when it let go, every AR byte each time.
    assert [(m["to"], m["bytes"]) for m in owner.moves] == [("device", ar_host_bytes(TINY_CONFIG)),
                                                            ("host", ar_host_bytes(TINY_CONFIG))]
    assert owner.moves[1]["why"] == "semantic phase (torch backend) done" and owner.holders == {}
    for name, tensor in model.named_parameters():  # the same host tensors as before: no second copy was made
        if name in host_tensors:
            assert tensor.data_ptr() == host_tensors[name].data_ptr(), name
    assert owner.describe()["moves"] == 2 and owner.where == "host"


def test_a_holder_elsewhere_waits_and_the_cpu_never_moves(tiny_model):
    owner = ARPlacement(tiny_model, "device")
    with owner.hold("host", "nar ode steps (--offload-ar)"), owner.hold("device", "torch song"):
        pass  # on the CPU every place is the same place
    assert owner.moves == []
    with pytest.raises(ValueError, match="place must be one of"):
        with owner.hold("gpu", "x"):
            pass


def test_the_streamed_prefill_equals_the_resident_one_bit_for_bit(tiny_model):
    tokens, frames = list(range(5, 45)), 6
    resident = CachedNAR(tiny_model, tokens, frames)
    streamed = CachedNAR(tiny_model, tokens, frames, stream=True)  # layer by layer through staged copies
    assert (resident.prefill_weights, streamed.prefill_weights) == ("resident", "streamed")
    layers = sum(t.numel() * t.element_size() for layer in tiny_model.model.layers
                 for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
                 for t in getattr(layer, name).parameters())
    assert resident.streamed_bytes == 0 and streamed.streamed_bytes == layers
    for (k1, v1), (k2, v2) in zip(resident.kv, streamed.kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    state = torch.randn(frames, TINY_CONFIG.latent_dim, generator=torch.Generator().manual_seed(0)).to(tiny_model.dtype)
    assert torch.equal(resident.velocity(state, 0.3), streamed.velocity(state, 0.3))
    assert placement_of(tiny_model).moves == []  # streaming copies; it never moves the model's own weights
