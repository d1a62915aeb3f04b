"""``vlm.model_chat_template``: a checkpoint's chat template read as SGLang's (a prefix and suffix per
role, the default system prompt, the image part), the prompt a program then writes equal to the
template's own rendering; a template whose roles are not a fixed prefix and suffix refused."""

from __future__ import annotations

import pytest
import sglang as sgl

import sgl_embeds
from sgl_embeds.vlm import render_chat
from sgl_embeds.vlm.prompt import model_chat_template
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import ImageText

# Qwen2-VL's form: a default system turn when none is given, an image as its vision tokens
WITH_DEFAULT_SYSTEM = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a turn unlike the others (the first, the last): no fixed prefix and suffix
FIRST_TURN_SPECIAL = ("{% for m in messages %}{% if loop.first %}[first] {% endif %}{{ m['role'] }}: "
                      "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}<end>{% endfor %}")
LAST_TURN_SPECIAL = ("{% for m in messages %}{{ m['role'] }}: {% for part in m['content'] %}{{ part['text'] }}"
                     "{% endfor %}{% if loop.last %} [last]{% endif %}<end>{% endfor %}")


def _checkpoint(tmp_path, template: str):
    (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_a_program_writes_what_the_template_renders(tmp_path):
    folder = _checkpoint(tmp_path, WITH_DEFAULT_SYSTEM)
    template = model_chat_template(folder, "<|image_pad|>")
    assert template.default_system_prompt == "You are a helpful assistant."
    assert template.image_part == ("<|vision_start|>", "<|vision_end|>")

    class Like:  # compile_program takes a backend's chat template and vision encoder
        chat_template, vision_encoder = template, None

    @sgl.function
    def two_turns(s, rows):
        s += sgl.user(sgl_embeds.image_part(rows) + "what is it")
        s += sgl.assistant(sgl.gen("a", max_tokens=2))
        s += sgl.user("and its color")
        s += sgl.assistant(sgl.gen("b", max_tokens=2))

    calls = sgl_embeds.compile_program(two_turns, like=Like(), rows=[[0.0] * 4])
    texts = ["".join(s.text if isinstance(s, seg.Text) else "<|image_pad|>" for s in call) for call in calls]
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    assert texts[0] == render_chat(folder, first)
    then = first + [{"role": "assistant", "content": [{"type": "text", "text": ""}]},
                    {"role": "user", "content": [{"type": "text", "text": "and its color"}]}]
    assert texts[1] == render_chat(folder, then)


@pytest.mark.parametrize("template, where", [(FIRST_TURN_SPECIAL, "the default system turn"),
                                             (LAST_TURN_SPECIAL, "a user turn")])
def test_a_template_without_a_fixed_prefix_per_role_is_refused(tmp_path, template, where):
    with pytest.raises(ValueError, match=f"not a fixed prefix and suffix per role \\({where}\\)"):
        model_chat_template(_checkpoint(tmp_path, template), "<image>")


def test_a_template_without_one_image_token_per_image_is_refused(tmp_path):
    with pytest.raises(ValueError, match="an image part renders"):
        model_chat_template(_checkpoint(tmp_path, WITH_DEFAULT_SYSTEM), "<image>")


def test_gemmas_system_in_the_first_user_turn_and_its_expanded_images(tmp_path):
    """Gemma 3's template: the bos first (the server writes it), a system turn's text inside the
    first user turn, an image part written as ``<start_of_image>`` that the processor expands."""
    from sgl_embeds_testing.gemma3 import BOI, CHAT_TEMPLATE, EOI, IMAGE

    folder = _checkpoint(tmp_path, CHAT_TEMPLATE.replace("{{ bos_token }}", "<bos>"))
    image_text = ImageText(BOI, f"\n\n{BOI}", f"{EOI}\n\n")
    template = model_chat_template(folder, IMAGE, image_text, "<bos>")
    assert template.system_in_user and template.default_system_prompt is None
    assert template.image_part == (f"\n\n{BOI}", f"{EOI}\n\n")

    class Like:
        chat_template, vision_encoder = template, None

    @sgl.function
    def with_system(s, rows):
        s += sgl.system("Be brief.")
        s += sgl.user(sgl_embeds.image_part(rows) + "what is it")
        s += sgl.assistant(sgl.gen("a", max_tokens=2))
        s += sgl.user("and its color")
        s += sgl.assistant(sgl.gen("b", max_tokens=2))

    calls = sgl_embeds.compile_program(with_system, like=Like(), rows=[[0.0] * 4])
    texts = ["".join(s.text if isinstance(s, seg.Text) else IMAGE for s in call) for call in calls]
    first = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    assert texts[0] == image_text.expand(render_chat(folder, first), IMAGE).removeprefix("<bos>")
    then = first + [{"role": "assistant", "content": [{"type": "text", "text": ""}]},
                    {"role": "user", "content": [{"type": "text", "text": "and its color"}]}]
    assert texts[1] == image_text.expand(render_chat(folder, then), IMAGE).removeprefix("<bos>")

    @sgl.function
    def late_system(s):
        s += sgl.user("hello")
        s += sgl.system("Be brief.")

    # SGLang's interpreter turns a program's error into a warning (and the state's error)
    with pytest.warns(UserWarning, match="a system turn comes first"):
        sgl_embeds.compile_program(late_system, like=Like())


@pytest.mark.parametrize("layout", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json",
                                    "tokenizer_config.json, named"])
def test_the_template_is_read_where_published_checkpoints_keep_it(tmp_path, layout):
    """Published Qwen-VL repositories keep the template in chat_template.json and in
    tokenizer_config.json (no .jinja): each is read, in transformers' order, and renders alike."""
    import json

    from sgl_embeds.vlm.prompt import chat_template_of

    file = layout.split(",")[0]
    if file.endswith(".jinja"):
        (tmp_path / file).write_text(WITH_DEFAULT_SYSTEM)
    elif layout.endswith("named"):  # a tokenizer's named templates: the default one is the chat's
        (tmp_path / file).write_text(json.dumps({"chat_template": [
            {"name": "tool_use", "template": FIRST_TURN_SPECIAL}, {"name": "default", "template": WITH_DEFAULT_SYSTEM}]}))
    else:
        (tmp_path / file).write_text(json.dumps({"chat_template": WITH_DEFAULT_SYSTEM}))
    assert chat_template_of(tmp_path) == WITH_DEFAULT_SYSTEM
    assert model_chat_template(tmp_path, "<|image_pad|>").image_part == ("<|vision_start|>", "<|vision_end|>")
    if file != "chat_template.jinja":  # the processor's own file comes first
        (tmp_path / "chat_template.jinja").write_text(LAST_TURN_SPECIAL)
        assert chat_template_of(tmp_path) == LAST_TURN_SPECIAL


def test_a_checkpoint_without_a_template_says_where_it_looked(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 8}')
    with pytest.raises(FileNotFoundError, match="chat_template.jinja, chat_template.json, tokenizer_config.json"):
        render_chat(tmp_path, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
