"""Tokenizers for jsteer models: a thin wrapper over the Rust ``tokenizers`` library.

Sources:

- ``tokenizer.json`` (any HF fast tokenizer), with special tokens taken from the folder's
  ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``config.json`` when present;
- ``vocab.txt`` (BERT WordPiece), lower-cased unless ``do_lower_case`` is false;
- ``vocab.json`` + ``merges.txt`` (byte-level BPE: GPT-2, RoBERTa);
- the tokenizer JSON that ``jsteer.convert.gguf`` builds from GGUF metadata (special ids
  passed in explicitly).

From a folder it also takes the chat template (``chat_template.jinja``, else
tokenizer_config.json's ``chat_template``; rendered by :meth:`Tokenizer.apply_chat_template`)
and extra stop ids (every ``eos_token_id`` generation_config.json lists, e.g. Llama 3's
end-of-turn ids).

Padding and truncation stored in a tokenizer.json are switched off: ``encode`` always returns
the raw ids, and :meth:`Tokenizer.batch_encode` pads explicitly (left or right).

The serialised form (:meth:`Tokenizer.to_json`) is a JSON object
``{"format": "jsteer.tokenizer/1", "tokenizer": <tokenizers JSON>, "special_ids": {...},
"chat_template": str | null, "extra_stop_ids": [...]}`` (the last two optional);
:meth:`Tokenizer.from_json` also accepts a plain tokenizers JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

PathLike = str | os.PathLike

FORMAT = "jsteer.tokenizer/1"
ROLES = ("pad", "bos", "eos", "unk", "mask", "cls", "sep")

# Fallback guesses when no config names a role (checked in order; first present wins).
_GUESSES = {
    "pad": ("[PAD]", "<pad>", "<|pad|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<|startoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>"),
    "unk": ("[UNK]", "<unk>", "<|unk|>"),
    "mask": ("[MASK]", "<mask>"),
    "cls": ("[CLS]",),
    "sep": ("[SEP]",),
}
# Extra tokens that end a generation when they exist as special tokens (chat / doc ends).
_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
TOKENIZER_FILES = "tokenizer.json, vocab.txt and vocab.json + merges.txt"  # what from_dir looks for


def _token_content(v) -> Optional[str]:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(path: pathlib.Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


class Tokenizer:
    """Encode/decode text with explicit special-token ids.

    Args:
      tk: a ``tokenizers.Tokenizer``. Its stored padding/truncation are disabled.
      special_ids: {role: id} for roles in :data:`ROLES`; a missing role is guessed from the
        vocabulary (e.g. ``[PAD]``, ``</s>``), else None.
      chat_template: a Jinja chat template (see :mod:`jsteer.chat_template`), or None.
      extra_stop_ids: ids that also end a generation (beyond eos and the end-of-turn specials).
    """

    def __init__(
        self,
        tk,
        special_ids: Optional[Mapping[str, Optional[int]]] = None,
        *,
        chat_template: Optional[str] = None,
        extra_stop_ids: Iterable[int] = (),
    ):
        tk.no_padding()
        tk.no_truncation()
        self._tk = tk
        special_ids = dict(special_ids or {})
        unknown = set(special_ids) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown special-token roles {sorted(unknown)}; expected a subset of {ROLES}")
        vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.special_ids: dict[str, Optional[int]] = {}
        for role in ROLES:
            i = special_ids.get(role)
            if i is None:
                i = next((tk.token_to_id(t) for t in _GUESSES[role] if tk.token_to_id(t) is not None), None)
            elif not 0 <= int(i) < vocab_size:
                raise ValueError(f"special token {role}={i} is outside the vocabulary (size {vocab_size})")
            self.special_ids[role] = None if i is None else int(i)
        self.chat_template = chat_template
        self.extra_stop_ids = tuple(int(i) for i in extra_stop_ids)
        bad = [i for i in self.extra_stop_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"stop id {bad[0]} is outside the vocabulary (size {vocab_size})")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_file(cls, path: PathLike, special_ids: Optional[Mapping[str, Optional[int]]] = None) -> "Tokenizer":
        """A ``tokenizer.json`` or ``vocab.txt`` file, or a folder holding one of them."""
        path = pathlib.Path(path)
        if path.is_dir():
            return cls.from_dir(path, special_ids)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        if path.name.endswith(".txt"):
            return cls.from_vocab_txt(path, special_ids=special_ids)
        return cls.from_tokenizer_json(path, special_ids)

    @classmethod
    def from_dir(
        cls, path: PathLike, special_ids: Optional[Mapping[str, Optional[int]]] = None, missing_ok: bool = False
    ) -> Optional["Tokenizer"]:
        """An HF model folder: ``tokenizer.json`` if present, else ``vocab.txt``. Special
        tokens come from ``special_ids``, then tokenizer_config.json, special_tokens_map.json
        and config.json (``*_token_id``), then guesses. A folder with none of
        these (:data:`TOKENIZER_FILES`): FileNotFoundError, or None with ``missing_ok``."""
        path = pathlib.Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {path}")
        tj, vt = path / "tokenizer.json", path / "vocab.txt"
        if tj.is_file():
            return cls.from_tokenizer_json(tj, special_ids)
        if vt.is_file():
            return cls.from_vocab_txt(vt, special_ids=special_ids)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return cls.from_bpe_files(path / "vocab.json", path / "merges.txt", special_ids=special_ids)
        if missing_ok:
            return None
        raise FileNotFoundError(f"no tokenizer in {path}: looked for {TOKENIZER_FILES}")

    @classmethod
    def from_tokenizer_json(
        cls, path: PathLike, special_ids: Optional[Mapping[str, Optional[int]]] = None
    ) -> "Tokenizer":
        from tokenizers import Tokenizer as _Tk

        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tk = _Tk.from_file(str(path))
        except Exception as e:  # the Rust side raises a generic Exception
            raise ValueError(f"{path}: cannot parse tokenizer ({e})") from None
        return cls._in_folder(tk, path.parent, _folder_special_tokens(path.parent), special_ids)

    @classmethod
    def from_vocab_txt(
        cls, path: PathLike, lowercase: Optional[bool] = None, special_ids: Optional[Mapping[str, Optional[int]]] = None
    ) -> "Tokenizer":
        """BERT WordPiece from ``vocab.txt`` (one token per line; line number = id).

        ``lowercase`` None reads ``do_lower_case`` from the folder's tokenizer_config.json
        (default True, as HF's BertTokenizer)."""
        from tokenizers import Tokenizer as _Tk
        from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"vocab file not found: {path}")
        tokens = path.read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            t = t.rstrip("\r")
            if t in vocab:
                raise ValueError(f"{path}:{i + 1}: duplicate token {t!r} (first on line {vocab[t] + 1})")
            vocab[t] = i
        if not vocab:
            raise ValueError(f"{path}: empty vocabulary")
        tc = path.parent / "tokenizer_config.json"
        cfg = _read_json(tc) if tc.is_file() else {}
        if lowercase is None:
            lowercase = bool(cfg.get("do_lower_case", True))
        names = _folder_special_tokens(path.parent)
        unk = names.get("unk", "[UNK]")
        if unk not in vocab:
            raise ValueError(f"{path}: unknown token {unk!r} is not in the vocabulary")
        tk = _Tk(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
        strip = cfg.get("strip_accents")
        tk.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=bool(cfg.get("tokenize_chinese_chars", True)),
            strip_accents=strip,
            lowercase=lowercase,
        )
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece(prefix="##")
        specials = [
            names.get(r, d)
            for r, d in (("pad", "[PAD]"), ("unk", "[UNK]"), ("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"))
        ]
        from tokenizers import AddedToken

        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials if s in vocab])
        cls_t, sep_t = names.get("cls", "[CLS]"), names.get("sep", "[SEP]")
        if cls_t in vocab and sep_t in vocab:
            tk.post_processor = processors.TemplateProcessing(
                single=f"{cls_t} $A {sep_t}",
                pair=f"{cls_t} $A {sep_t} $B:1 {sep_t}:1",
                special_tokens=[(cls_t, vocab[cls_t]), (sep_t, vocab[sep_t])],
            )
        return cls._in_folder(tk, path.parent, names, special_ids)

    @classmethod
    def from_bpe_files(
        cls, vocab_json: PathLike, merges_txt: PathLike, special_ids: Optional[Mapping[str, Optional[int]]] = None
    ) -> "Tokenizer":
        """Byte-level BPE from ``vocab.json`` + ``merges.txt`` (GPT-2 / RoBERTa folders without a
        tokenizer.json). RoBERTa-family folders (config.json model_type) get ``<s> ... </s>``."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as _Tk

        vocab_json, merges_txt = pathlib.Path(vocab_json), pathlib.Path(merges_txt)
        for f in (vocab_json, merges_txt):
            if not f.is_file():
                raise FileNotFoundError(f"BPE tokenizer file not found: {f}")
        try:
            bpe = models.BPE.from_file(str(vocab_json), str(merges_txt))
        except Exception as e:
            raise ValueError(f"{vocab_json} / {merges_txt}: cannot build a BPE tokenizer ({e})") from None
        tk = _Tk(bpe)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        folder = vocab_json.parent
        names = _folder_special_tokens(folder)
        vocab = tk.get_vocab()
        specials = {v for v in names.values() if isinstance(v, str)} | {
            "<|endoftext|>",
            "<s>",
            "</s>",
            "<pad>",
            "<unk>",
            "<mask>",
        }
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(specials) if t in vocab])
        cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        if cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert") and "<s>" in vocab and "</s>" in vocab:
            tk.post_processor = processors.RobertaProcessing(("</s>", vocab["</s>"]), ("<s>", vocab["<s>"]))
            names = {"cls": "<s>", "sep": "</s>", **names}
        return cls._in_folder(tk, folder, names, special_ids)

    @classmethod
    def _in_folder(
        cls,
        tk,
        folder: pathlib.Path,
        names: Mapping[str, str | int],
        special_ids: Optional[Mapping[str, Optional[int]]],
    ) -> "Tokenizer":
        """A tokenizer read from ``folder``, with the folder's special tokens, chat template and stop ids."""
        return cls(
            tk,
            _merge_special(tk, names, special_ids),
            chat_template=_folder_chat_template(folder),
            extra_stop_ids=_folder_stop_ids(folder, tk.get_vocab_size(with_added_tokens=True)),
        )

    @classmethod
    def from_json(cls, s: str | Mapping) -> "Tokenizer":
        """Inverse of :meth:`to_json`; also accepts a plain tokenizers JSON (string or dict)."""
        from tokenizers import Tokenizer as _Tk

        obj = json.loads(s) if isinstance(s, (str, bytes)) else dict(s)
        extra = {}
        if obj.get("format") == FORMAT:
            extra = {
                "special_ids": obj.get("special_ids"),
                "chat_template": obj.get("chat_template"),
                "extra_stop_ids": obj.get("extra_stop_ids") or (),
            }
            obj = obj["tokenizer"]
        try:
            tk = _Tk.from_str(json.dumps(obj))
        except Exception as e:
            raise ValueError(f"cannot parse tokenizer JSON ({e})") from None
        return cls(tk, **extra)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "tokenizer": json.loads(self._tk.to_str()),
                "special_ids": self.special_ids,
                "chat_template": self.chat_template,
                "extra_stop_ids": list(self.extra_stop_ids),
            }
        )

    # ------------------------------------------------------------------ special ids

    pad_id = property(lambda self: self.special_ids["pad"])
    bos_id = property(lambda self: self.special_ids["bos"])
    eos_id = property(lambda self: self.special_ids["eos"])
    unk_id = property(lambda self: self.special_ids["unk"])
    mask_id = property(lambda self: self.special_ids["mask"])
    cls_id = property(lambda self: self.special_ids["cls"])
    sep_id = property(lambda self: self.special_ids["sep"])

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: eos, common end-of-text / end-of-turn specials, then
        :attr:`extra_stop_ids` (a folder's generation_config.json eos ids)."""
        ids = [] if self.eos_id is None else [self.eos_id]
        special = {t.content for t in self._tk.get_added_tokens_decoder().values() if t.special}
        for t in _END_TOKENS:
            i = self._tk.token_to_id(t)
            if t in special and i is not None and i not in ids:
                ids.append(i)
        ids += [i for i in self.extra_stop_ids if i not in ids]
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=skip_special_tokens)

    def decode_continuation(self, prompt_ids: Iterable[int], new_ids: Iterable[int]) -> str:
        """The text ``new_ids`` add after ``prompt_ids``: decode(prompt + new) minus decode(prompt).
        Decoding ``new_ids`` alone loses what depends on the left context: a SentencePiece
        (Metaspace) decoder strips the word-boundary space of the first token it sees, so
        ['▁great', '▁day'] after "The movie was" alone reads "great day", not " great day".
        Falls back to decoding ``new_ids`` alone where the joint text does not start with the
        prompt's (e.g. a character split across the boundary)."""
        prompt = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
        new = [int(i) for i in np.asarray(new_ids).reshape(-1)]
        head, full = self.decode(prompt), self.decode(prompt + new)
        return full[len(head) :] if full.startswith(head) else self.decode(new)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = False, **kwargs) -> str:
        """``messages`` ([{"role": "user", "content": "Hi"}, ...]) -> prompt text, rendered from
        :attr:`chat_template` as transformers' ``apply_chat_template(..., tokenize=False)`` does
        (see :mod:`jsteer.chat_template`); ``kwargs`` reach the template. Encode the result with
        ``add_special_tokens=False``: the template writes the specials itself."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (none in its tokenizer_config.json, "
                "chat_template.jinja or GGUF metadata); format the prompt yourself"
            )
        from jsteer.chat_template import render

        names = {f"{role}_token": self.id_to_token(i) for role, i in self.special_ids.items() if i is not None}
        return render(self.chat_template, messages, add_generation_prompt, special_tokens=names, **kwargs)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tk.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tk.id_to_token(int(i))

    def batch_encode(
        self,
        texts: Sequence[str],
        max_len: Optional[int] = None,
        left_pad: bool = False,
        add_special_tokens: bool = True,
        pad_to: Optional[int] = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """texts -> (ids int32 [B, T], mask int32 [B, T]); mask is 1 on real tokens.

        T is the longest encoding (``pad_to`` raises it to at least that). With ``max_len``,
        longer encodings are cut: the start is kept when padding right, the end (the text
        nearest the continuation) when padding left. Pads use ``pad_id`` (else eos, else 0).
        """
        if isinstance(texts, str):
            raise TypeError("batch_encode expects a list of strings, got a single str")
        texts = list(texts)
        if not texts:
            raise ValueError("batch_encode needs at least one text")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"batch_encode: texts[{i}] is a {type(t).__name__}, not a str")
        encs = [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=add_special_tokens)]
        if max_len is not None:
            if max_len < 1:
                raise ValueError(f"max_len must be >= 1, got {max_len}")
            encs = [e[-max_len:] if left_pad else e[:max_len] for e in encs]
        T = max(max(len(e) for e in encs), 1)
        if pad_to is not None:
            T = max(T, int(pad_to))
        pad = self.pad_id if self.pad_id is not None else (self.eos_id if self.eos_id is not None else 0)
        ids = np.full((len(encs), T), pad, np.int32)
        mask = np.zeros((len(encs), T), np.int32)
        for b, e in enumerate(encs):
            n = len(e)
            if n == 0:
                continue
            sl = slice(T - n, T) if left_pad else slice(0, n)
            ids[b, sl] = e
            mask[b, sl] = 1
        return ids, mask

    def __repr__(self) -> str:
        named = ", ".join(f"{r}={i}" for r, i in self.special_ids.items() if i is not None)
        return f"Tokenizer(vocab_size={self.vocab_size}, {named})"


# ---------------------------------------------------------------------- special-token lookup


def _folder_special_tokens(folder: pathlib.Path) -> dict[str, str | int]:
    """{role: token string or id} named by an HF folder's config files (later files do not
    override earlier ones): tokenizer_config.json, special_tokens_map.json, config.json ids."""
    names: dict[str, str | int] = {}
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / fname
        if not f.is_file():
            continue
        cfg = _read_json(f)
        for role in ROLES:
            t = _token_content(cfg.get(f"{role}_token"))
            if t is not None:
                names.setdefault(role, t)
    f = folder / "config.json"
    if f.is_file():
        cfg = _read_json(f)
        for role in ("pad", "bos", "eos"):
            i = cfg.get(f"{role}_token_id")
            if isinstance(i, list):  # some configs list several eos ids; the first is canonical
                i = i[0] if i else None
            if isinstance(i, int):
                names.setdefault(role, i)
    return names


def _folder_chat_template(folder: pathlib.Path) -> Optional[str]:
    """``chat_template.jinja`` (what transformers 5 writes; it wins, as in transformers), else
    tokenizer_config.json's ``chat_template`` (a string, or a list of named templates: "default")."""
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    tc = folder / "tokenizer_config.json"
    template = _read_json(tc).get("chat_template") if tc.is_file() else None
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, Mapping) and t.get("name") == "default"), None
        )
    return template if isinstance(template, str) else None


def _folder_stop_ids(folder: pathlib.Path, vocab_size: int) -> tuple[int, ...]:
    """generation_config.json's ``eos_token_id`` (an int or a list), the ids HF generate stops
    on; ids outside the vocabulary are dropped with a warning."""
    f = folder / "generation_config.json"
    eos = _read_json(f).get("eos_token_id") if f.is_file() else None
    ids: list[int] = []
    for i in eos if isinstance(eos, list) else [eos]:
        if not isinstance(i, int) or i in ids:
            continue
        if 0 <= i < vocab_size:
            ids.append(i)
        else:
            warnings.warn(
                f"{f}: eos_token_id {i} is outside the tokenizer's vocabulary (size {vocab_size}); "
                f"not used as a stop id",
                stacklevel=5,
            )
    return tuple(ids)


def _merge_special(
    tk, names: Mapping[str, str | int], explicit: Optional[Mapping[str, Optional[int]]]
) -> dict[str, Optional[int]]:
    out: dict[str, Optional[int]] = {}
    size = tk.get_vocab_size(with_added_tokens=True)
    for role, v in names.items():
        if isinstance(v, int) and not 0 <= v < size:  # an id from config.json (HF's defaults, e.g. GPT-2's 50256)
            warnings.warn(
                f"config.json {role}_token_id {v} is outside the tokenizer's vocabulary (size {size}); "
                f"ignored (the {role} token is taken from the tokenizer's own tokens)",
                stacklevel=4,
            )
            continue
        out[role] = v if isinstance(v, int) else tk.token_to_id(v)
    for role, v in (explicit or {}).items():
        if v is not None:
            out[role] = int(v)
    return out


__all__ = ["Tokenizer", "ROLES", "FORMAT", "TOKENIZER_FILES"]
