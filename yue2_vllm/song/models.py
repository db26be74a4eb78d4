"""The song's loaded weights: where they came from, their identity (sha256s), the tokenizer, the MoT, the VAE
(loaded on first decode), and where the VAE sits beside the MoT's AR expert for a decode (placement)."""
from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from ..checkpoint import HashCache, drop_page_cache, model_identity, weights_bytes
from ..devices import empty_cache
from ..hub import ModelSource
from ..memory import vae_decode_bytes
from ..model.loader import load_model
from ..model.nar import offloaded_ar
from ..model.placement import placement_of
from ..model.torch_quant import module_bytes, proxy_slow_reason
from ..model.vae import check_vae, load_vae
from ..options import AROptions
from ..startup import STARTUP, block_counter
from ..tokenizer import YuE2Tokenizer

LOG = logging.getLogger(__name__)
VAE_HALO_FRAMES = 16
SLOW_LOAD_ENV = "YUE2_TEST_LOAD_DELAY_S"  # tests only: seconds added to the MoT load (a server's slow start-up)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # float32: verification runs of both AR backends


class LoadedModels:
    """The weights one pipeline serves: identified (hashed, the VAE's files checked) on construction, the MoT
    loaded by `load_mot`, the VAE on first use of `vae`."""

    def __init__(self, sources: dict[str, ModelSource | None], *, hashes: HashCache, verify_hashes: bool,
                 unified: bool):
        start = time.perf_counter()
        self.sources = sources
        self.model_dir = sources["mot"].path
        self.vae_dir = sources["vae"].path if sources["vae"] is not None else None
        self.hashes, self.verify_hashes = hashes, verify_hashes
        self.weights = {"mot": self._hashed(self.model_dir, "model"),
                        "vae": self._hashed(self.vae_dir, "vae") if self.vae_dir is not None else None}
        # Checked now (config, names, shapes, float32), not after the AR and NAR stages have run.
        self.vae_config = check_vae(self.vae_dir) if self.vae_dir is not None else None
        self.identity_seconds = time.perf_counter() - start
        self.tokenizer = YuE2Tokenizer.from_model_dir(self.model_dir)
        self.unified = unified  # one memory pool: file pages are dropped once the weights are in it
        self.model = None
        self.quantization_status: dict = {}
        self.proxy_mode: str | None = None  # load-time proxies' mode: they serve the torch AR phases only
        self._vae = None

    def _hashed(self, directory, what: str) -> dict:
        """The weights' identity, the hashing recorded as a start-up step (bytes read; 0 on hash-cache hits)."""
        with STARTUP.step("hashing", what, weights_bytes(directory)) as step:
            return model_identity(directory, hashes=self.hashes, verify=self.verify_hashes,
                                  on_block=block_counter(step))

    def load_mot(self, device: torch.device, ar: AROptions, ar_on_device: bool) -> None:
        """Load the MoT; load-time proxies without a fast kernel on this device are declined on the record."""
        quantization, dtype = ar.quantization, ar.dtype
        declined = proxy_slow_reason(quantization, device, DTYPES[dtype]) if ar.quantized_policy != "force" else None
        with STARTUP.step("loading", "model", weights_bytes(self.model_dir)):
            time.sleep(float(os.environ.get(SLOW_LOAD_ENV) or 0))  # tests only: a load that takes a while
            self.model = load_model(self.model_dir, device=device, dtype=DTYPES[dtype],
                                    quantization="none" if declined else quantization, ar_on_device=ar_on_device)
        if self.unified:  # the MoT is in (unified) memory now; its file pages need not be too
            drop_page_cache(self.model_dir)
        if declined:
            LOG.info("load-time %s proxies declined: %s", quantization, declined)
            self.model.quantization_status = {**self.model.quantization_status, "requested": quantization,
                                              "declined": declined}
        self.quantization_status = dict(self.model.quantization_status)
        # Load-time proxies serve the torch AR phases only; the NAR always runs on the exact originals.
        self.proxy_mode = quantization if self.quantization_status.get("source") == "load_time" else None

    @property
    def vae(self):
        """The fp32 VAE decoder, loaded on first use (a pipeline may only plan or generate tokens)."""
        if self._vae is None:
            if self.vae_dir is None:
                raise ValueError("this pipeline was built without a VAE directory; it cannot decode audio")
            self._vae = load_vae(self.vae_dir, device="cpu")
            if self.unified:
                drop_page_cache(self.vae_dir)
        return self._vae

    def source_records(self) -> dict:
        """Where the weights were read from (a Hub repo's revision, commit and snapshot path, or the local
        directory): recorded beside the identity, not in it (the weights' sha256s are)."""
        return {name: source.record() if source is not None else None for name, source in self.sources.items()}


def vae_placement(vae, model, device: torch.device, core_frames: int, room: int | None, movable: bool) -> dict:
    """Where a decode runs: the tile's working set plus the VAE (unless already resident) against the device's
    room; the AR expert moves to the host only when it is `movable` (a discrete GPU without the engine, the
    expert on the device) and the device cannot hold both."""
    resident = vae.decoder_device == device
    need = vae_decode_bytes(vae.config, core_frames, VAE_HALO_FRAMES) + (0 if resident else module_bytes(vae))
    move_ar = movable and placement_of(model).home == "device" and room is not None and need > room
    return {"device": str(device), "need_bytes": need, "room_bytes": room, "ar_moved": move_ar}


@contextlib.contextmanager
def vae_on_device(vae, model, device: torch.device, move_ar: bool):
    """The fp32 VAE on `device` for one decode. It stays there afterwards, as the memory plan budgets it beside
    the MoT; with `move_ar` the AR expert leaves the device for the decode (held on the host by its placement
    owner, which waits for any stage using it and brings it back after) and the VAE goes back to the CPU, also
    on errors and cancellation; allocator caches are emptied around it."""
    with offloaded_ar(model, move_ar):
        try:
            if move_ar:
                empty_cache(device)
            vae.to(device)
            yield vae
        finally:
            if move_ar:
                vae.to("cpu")
            empty_cache(device)
