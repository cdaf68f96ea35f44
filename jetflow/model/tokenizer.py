"""Tokenizers with one small interface, needing only `tokenizers` and `jinja2` at runtime.

- `Tokenizer`: a HF tokenizer directory (tokenizer.json + tokenizer_config.json, chat template from
  tokenizer_config.json or chat_template.jinja), rendered the way transformers renders chat templates.
- `CharTokenizer`: one token per character of a fixed alphabet, for tiny synthetic models.

Interface: encode(text) -> list[int], decode(ids) -> str, apply_chat_template(messages,
add_generation_prompt=True) -> str, and the attributes vocab_size, bos_token_id, eos_token_id,
pad_token_id.

`encode` adds no special tokens by default: jetflow encodes text rendered by the chat template, which
already contains them (transformers' `apply_chat_template(tokenize=True)` does the same).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jetflow.errors import UserError

CHAR_TOKENIZER_FILE = "char_tokenizer.json"
RESTORE = "restore it from the model's source"


class TokenizerError(UserError, ValueError):
    """A tokenizer file that cannot be read, or text it cannot encode; the message names the file or
    the character."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot parse {path}: {_first_line(e)}; {RESTORE}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object but a {type(data).__name__}; {RESTORE}")
    return data


def _environment():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_template(template: str, source: str) -> None:
    """Compile a chat template once at load: a syntax error names its file and line."""
    from jinja2.exceptions import TemplateSyntaxError
    try:
        _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template in {source} is not valid Jinja: {e.message} at line {e.lineno}; "
                             f"{RESTORE}") from None


def _render(template: str, messages: list[dict], add_generation_prompt: bool, source: str = "the tokenizer",
            **kwargs) -> str:
    """Render a chat template with the jinja2 settings transformers uses; a template that fails names
    `source` (its file)."""
    from jinja2.exceptions import TemplateError
    try:
        return _environment().from_string(template).render(messages=messages,
                                                           add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateError as e:
        raise TokenizerError(f"the chat template in {source} failed: {_first_line(e)}") from None


def _token_str(tok) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """A HF tokenizer directory: tokenizer.json (+ tokenizer_config.json, chat_template.jinja)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"missing tokenizer file: {tok_file}")
        self.path = d
        try:
            self._tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise TokenizerError(f"cannot read {tok_file}: {_first_line(e)}; {RESTORE}") from None
        cfg_file = d / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.chat_template = cfg.get("chat_template")
        self.template_source = str(cfg_file)
        if (d / "chat_template.jinja").is_file():  # transformers >= 4.50 writes it separately
            self.template_source = str(d / "chat_template.jinja")
            try:
                self.chat_template = (d / "chat_template.jinja").read_text()
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{d / 'chat_template.jinja'} is not UTF-8 text ({e.reason}); {RESTORE}") from None
        if isinstance(self.chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            try:
                self.chat_template = {t["name"]: t["template"] for t in self.chat_template}.get("default")
            except (KeyError, TypeError):
                raise TokenizerError(f"{cfg_file}: chat_template is a list without name/template entries; "
                                     f"{RESTORE}") from None
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError(f"{cfg_file}: chat_template is a {type(self.chat_template).__name__}, not text; "
                                 f"{RESTORE}")
        if self.chat_template:
            check_template(self.chat_template, self.template_source)
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        # no pad token (common for decoder-only models): pad with eos; padding is masked anyway
        self.pad_token_id = self._id(self.pad_token) if self.pad_token is not None else self.eos_token_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"special token {token!r} of {self.path} is not in its vocabulary")
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as text; `kwargs` reach the template (``tools=[schema, ...]``, as transformers')."""
        if not self.chat_template:
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json / chat_template.jinja)")
        return _render(self.chat_template, messages, add_generation_prompt, self.template_source,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", pad_token=self.pad_token or "",
                       **kwargs)


class CharTokenizer:
    """One token per character of `alphabet`; ids 0, 1, 2 are pad, bos, eos; characters follow.

    The chat template (jinja2) defaults to the concatenated message contents, so a prompt is exactly
    the user's text."""

    PAD, BOS, EOS = "<pad>", "<s>", "</s>"
    DEFAULT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __init__(self, alphabet: str, chat_template: str | None = None, path: str | Path | None = None):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.path = path  # the char_tokenizer.json it was read from, if any (named in errors)
        self.alphabet = alphabet
        self.chat_template = chat_template or self.DEFAULT_TEMPLATE
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.specials = [self.PAD, self.BOS, self.EOS]
        self._ids = {ch: i + len(self.specials) for i, ch in enumerate(alphabet)}
        self.vocab_size = len(self.specials) + len(alphabet)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as e:
            ch = e.args[0]
            where = f" of {self.path}" if self.path else ""
            raise TokenizerError(f"character {ch!r} (U+{ord(ch):04X}, at position {text.index(ch)} of the text) is "
                                 f"not in the CharTokenizer alphabet{where}; it knows only {self.alphabet!r}") from None
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < len(self.specials):
                if not skip_special_tokens:
                    out.append(self.specials[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(self.specials)])
            else:
                raise ValueError(f"token id {i} out of range for CharTokenizer (vocab {self.vocab_size})")
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return _render(self.chat_template, messages, add_generation_prompt, str(self.path or "the CharTokenizer"),
                       **kwargs)

    def save(self, path: str | Path) -> Path:
        """Write char_tokenizer.json into directory `path` (or to `path` if it ends in .json)."""
        p = Path(path)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / CHAR_TOKENIZER_FILE
        p.write_text(json.dumps({"type": "char", "alphabet": self.alphabet, "chat_template": self.chat_template}) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        p = Path(path)
        if p.is_dir():
            p = p / CHAR_TOKENIZER_FILE
        if not p.is_file():
            raise FileNotFoundError(f"missing tokenizer file: {p}")
        d = _read_json(p)
        if d.get("type") != "char" or not isinstance(d.get("alphabet"), str):
            raise TokenizerError(f"{p} is not a CharTokenizer file (type 'char' and an alphabet); {RESTORE}")
        try:
            tok = cls(d["alphabet"], d.get("chat_template"), path=p)
        except ValueError as e:
            raise TokenizerError(f"{p}: {e}; {RESTORE}") from None
        if d.get("chat_template"):
            check_template(d["chat_template"], str(p))
        return tok


def load_tokenizer(path: str | Path) -> Tokenizer | CharTokenizer:
    """CharTokenizer if `path` holds char_tokenizer.json, else a HF Tokenizer (tokenizer.json)."""
    p = Path(path)
    if p.is_file() and p.name == CHAR_TOKENIZER_FILE:
        return CharTokenizer.load(p)
    if (p / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer.load(p)
    if (p / "tokenizer.json").is_file():
        return Tokenizer(p)
    raise FileNotFoundError(f"no tokenizer in {p}: expected {p / 'tokenizer.json'} or {p / CHAR_TOKENIZER_FILE}")


def render_prompt(tokenizer: Tokenizer | CharTokenizer, prompt: str | list[dict], chat: bool) -> str:
    """The text a prompt is tokenized from: with `chat` and a tokenizer that has a chat template, the
    prompt as one user message in it (with the generation prompt), else the prompt itself. A prompt
    that is a conversation (a list of {"role", "content"} messages) is always rendered by the chat
    template (ValueError when the tokenizer has none). The one place that decides; training, the
    benches and `jetflow generate` go through it."""
    if not isinstance(prompt, str):
        if not tokenizer.chat_template:
            raise ValueError("a chat-format prompt (a list of messages) needs a tokenizer with a chat template; this "
                             "model's tokenizer has none: give the prompt as text")
        return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return prompt


def eos_token_ids(tokenizer: Tokenizer | CharTokenizer, model_config) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the model config's eos_token_id (an id or a
    list of them, as Llama 3's and Qwen's configs give several)."""
    ids = {tokenizer.eos_token_id}
    eos = model_config.eos_token_id
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(int(i) for i in ids if i is not None)


def encode_prompt(tokenizer: Tokenizer | CharTokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """A prompt's token ids as a run encodes them (render_prompt, then the tokenizer): the one function
    behind the rollout's prompts and the pre-run length checks."""
    return tokenizer.encode(render_prompt(tokenizer, prompt, chat))
