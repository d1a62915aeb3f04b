"""The LLaVA families against their servers, for the parity modules (``vlm/test_llava15_parity.py``,
``vlm/test_llava_next_parity.py``): a split checkpoint behind the pool's server of its LLM, the
client's vision half, and the calls every parity test makes.

``harness_fixtures({family: server name})`` gives a module its ``vlm`` fixture (one harness per
family) and the autouse fixture that keeps that family's server running for each test.
"""

from __future__ import annotations

import functools

import pytest
import sglang as sgl
from PIL import Image

import helpers
import sgl_embeds
from sgl_embeds import EmbedsEndpoint
from sgl_embeds_testing import reference as ref
from sgl_embeds.vlm import image_prompt, load_encoder, render_chat

MAX_TOKENS = 10
MIN_COMPARED = 8


def question(text: str, images: int = 1) -> list[dict]:
    """One user turn: ``images`` image parts, then the text."""
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@sgl.function
def ask(s, text, images, image_token):
    s += image_prompt(text, images, image_token)
    s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)


def run_program(backend: EmbedsEndpoint, text: str, program_images: list) -> dict:
    """``ask``'s answer (the images at the encoder's image tokens of ``text``), checked equal to
    that of the same segments sent by ``EmbedsEndpoint.run``, whose output (ids, logprobs, top-3
    maps) is returned."""
    token = backend.vision_encoder.image_token
    state = ask.run(text=text, images=program_images, image_token=token, backend=backend)
    sent = sgl_embeds.compile_program(ask, like=backend, text=text, images=program_images,
                                      image_token=token)[0]
    direct = backend.run(input_segments=sent, return_logprob=True, top_logprobs_num=ref.TOP_K,
                         sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    assert state["answer"] == direct["text"]
    return direct


class LlavaHarness:
    """One split checkpoint of a LLaVA family behind the pool's server ``server_name``."""

    def __init__(self, server_name: str, checkpoint, split_dir, server,
                 backend: EmbedsEndpoint | None = None) -> None:
        """``backend``: one with its vision encoder (``sgl_embeds.connect``'s), else one with the
        encoder of ``split_dir``."""
        self.server_name, self.checkpoint, self.split_dir, self.server = server_name, checkpoint, split_dir, server
        if backend is None:
            backend = EmbedsEndpoint(server.url, vision_encoder=load_encoder(split_dir / "vision", device="cpu"))
        self.backend, self.encoder = backend, backend.vision_encoder

    def text(self, words: str, images: int = 1) -> str:
        """The checkpoint's chat template on one user turn of ``images`` images and ``words``."""
        return render_chat(self.split_dir / "vision", question(words, images))

    def generate(self, text: str, images: list[Image.Image]) -> dict:
        """``/generate`` with the text around each image token and the encoder's rows of each
        image as a span where the token stands."""
        pieces = text.split(self.encoder.image_token)
        assert len(pieces) == len(images) + 1, text
        segments = [helpers.text(pieces[0])]
        for image, piece in zip(images, pieces[1:]):
            rows = self.encoder(image)
            assert len(rows) == self.encoder.rows_for(*image.size)
            segments += [helpers.span(rows), helpers.text(piece)]
        return helpers.generate(self.server, helpers.body(segments, MAX_TOKENS, return_logprob=True))

    def run(self, text: str, program_images: list) -> dict:
        return run_program(self.backend, text, program_images)

    def check(self, out: dict, text: str, hf_images: list, label: str) -> list[int]:
        """Our tokens vs HF's LLaVA class on ``hf_images`` (near-tie rule), and their logprobs;
        returns HF's reference tokens."""
        greedy = functools.partial(ref.llava_greedy, self.checkpoint, text, hf_images, MAX_TOKENS)
        eos = ref.eos_ids(ref.hf_llava(str(self.checkpoint))[0])
        return ref.assert_vlm_matches_hf(out, greedy, eos, f"{label}: ", MIN_COMPARED).tokens


def harness_fixtures(server_of: dict[str, str]):
    """A parity module's ``vlm`` fixture (a ``LlavaHarness`` per family: ``server_of`` maps the
    family's ``llava_dirs`` name to its pool server) and its autouse server fixture."""

    @pytest.fixture(scope="module", params=helpers.pooled(server_of, server_of.get))
    def vlm(request, llava_dirs, servers):
        name = server_of[request.param]
        return LlavaHarness(name, *llava_dirs(request.param), servers.get(name)[0])

    @pytest.fixture(autouse=True)
    def _vlm_server_runs(vlm, servers):
        servers.get(vlm.server_name)  # the pool may have stopped it since the module's fixture was made

    return vlm, _vlm_server_runs
