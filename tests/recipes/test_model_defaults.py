"""A model served without a recipe samples with its own defaults (issue 19.1): its GGUF's
``general.sampling.*``, its ``generation_config.json``, else the bundled recipe of the same model."""

from __future__ import annotations

import json

import gguf
import pytest

from spark.recipes.model_defaults import _gguf_sampling, model_sampling
from spark.recipes.schema import Sampling
from spark.recipes.serving import implicit_recipe
from spark.serve_config import ServeConfig

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_the_embedded_model_takes_its_bundled_recipes_sampling():
    sampling, source = model_sampling("default")
    assert (sampling.temperature, sampling.top_p) == (0.2, 0.9) and source == "recipe smollm2-135m-instruct"
    assert implicit_recipe(ServeConfig()).sampling == sampling  # plain `spark serve` used temperature 1.0


def test_the_embedded_file_by_its_path_is_the_same_model():
    from spark.engine.weights import default_model_path

    sampling, source = model_sampling(str(default_model_path()))
    assert sampling.temperature == 0.2 and source == "recipe smollm2-135m-instruct"


def test_an_hf_directory_says_it_in_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300,
         "bos_token_id": 1}))
    sampling, source = model_sampling(str(tmp_path), recipes_dir=tmp_path / "none")
    assert sampling == Sampling(temperature=0.6, top_p=0.95, top_k=20, max_tokens=300)
    assert source == str(tmp_path)


def test_a_gguf_says_it_in_its_sampling_keys(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = _gguf_sampling(path)
    assert found == {"temperature": pytest.approx(0.7), "top_p": pytest.approx(0.8), "top_k": 40}


def test_dummy_weights_and_silent_models_keep_the_apis_defaults(tmp_path):
    assert model_sampling("dummy:tiny-llama") == (Sampling(), None)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert model_sampling(str(tmp_path), recipes_dir=tmp_path / "none") == (Sampling(), None)
    assert model_sampling(str(tmp_path / "missing")) == (Sampling(), None)  # loading it says why
