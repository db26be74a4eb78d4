import pytest

from yue2_vllm.testing import write_tiny_model, write_tiny_vae


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "YuE2-3B-tiny")


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("tiny") / "YuE2-Vae-tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from yue2_vllm.tokenizer import YuE2Tokenizer

    return YuE2Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from yue2_vllm.model.loader import load_model

    return load_model(tiny_model_dir)
