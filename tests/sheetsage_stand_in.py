"""A stand-in for SheetSage2's gated weights, for the tests: a model directory that transformers' AutoModel loads
with trust_remote_code, as it loads SheetSage2, whose `transcribe` answers as SheetSage2's does (its result dict,
or a RuntimeError carrying `.result` when it builds no score) with the score and beats its config holds; or one that
fails as it runs (`fail`: torch's OutOfMemoryError), or whose transcribe takes only the arguments SheetSage2's model
card documents (`documented_only`)."""
import json

import numpy as np

CONFIGURATION = '''
from transformers import PretrainedConfig


class StandInConfig(PretrainedConfig):
    model_type = "sheetsage2-stand-in"

    def __init__(self, abc="", beats=(), refuse=None, fail=None, documented_only=False, **kwargs):
        super().__init__(**kwargs)
        self.abc, self.beats, self.refuse = abc, list(beats), refuse
        self.fail, self.documented_only = fail, documented_only
'''
MODELING = '''
import json
import os

import torch
from transformers import PreTrainedModel

from .configuration_stand_in import StandInConfig


class StandIn(PreTrainedModel):
    """Answers transcribe() as SheetSage2 does (its result dict, RuntimeError with .result when no score), with the
    score and beats of its config; records how it was called."""

    config_class = StandInConfig

    def __init__(self, config):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.post_init()

    def _init_weights(self, module):
        pass

    def transcribe(self, audio, output_dir=None, *, melody_only=False, **options):
        # as SheetSage2's pipeline: the other options go on to its analyzer, whose signature refuses what it lacks
        analyze = self._documented if self.config.documented_only else self._analyze
        return analyze(audio, output_dir, melody_only=melody_only, **options)

    def _documented(self, audio, output_dir, *, melody_only):
        return self._analyze(audio, output_dir, melody_only=melody_only)

    def _analyze(self, audio, output_dir, *, melody_only, dtype="bf16", prompts=(), max_seconds=None,
                 overlap_seconds=None, lookahead_seconds=None):
        print("the model talks on stdout")
        if self.config.fail:
            raise torch.OutOfMemoryError(self.config.fail)
        os.makedirs(output_dir, exist_ok=True)
        call = {"audio_is_file": os.path.isfile(audio), "dtype": dtype, "prompts": list(prompts),
                "melody_only": melody_only, "max_seconds": max_seconds, "overlap_seconds": overlap_seconds,
                "lookahead_seconds": lookahead_seconds, "device": str(self.weight.device)}
        if self.config.refuse:
            error = RuntimeError(self.config.refuse)
            error.result = {"abc": None, "abc_error": self.config.refuse, "warnings": ["2 beats decoded"]}
            raise error
        with open(os.path.join(output_dir, "beat.lab"), "w") as handle:
            handle.writelines(f"{time:.4f}\\t{index % 4 + 1}\\n" for index, time in enumerate(self.config.beats))
        return {"abc": self.config.abc, "warnings": ["low confidence in bar 3", {"window": 1}],
                "labs": {}, "diagnostics": [json.dumps(call)], "window_seconds": 300.0,
                "overlap_seconds": 200.0 if overlap_seconds is None else overlap_seconds,
                "lookahead_seconds": 100.0 if lookahead_seconds is None else lookahead_seconds}
'''


def stand_in_model(directory, abc, beats=(), refuse=None, fail=None, documented_only=False):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "configuration_stand_in.py").write_text(CONFIGURATION)
    (directory / "modeling_stand_in.py").write_text(MODELING)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "sheetsage2-stand-in", "architectures": ["StandIn"],
        "auto_map": {"AutoConfig": "configuration_stand_in.StandInConfig", "AutoModel": "modeling_stand_in.StandIn"},
        "abc": abc, "beats": list(beats), "refuse": refuse, "fail": fail, "documented_only": documented_only}))
    save_file({"weight": np.zeros(1, np.float32)}, str(directory / "model.safetensors"))
    (directory / "yue2-sheetsage-revision.txt").write_text("0123abcd\n")
    return directory
