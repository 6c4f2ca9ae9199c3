"""A character-level tokenizer with a plain chat rendering, for data tests that must
not depend on a real vocabulary: ids 0-3 are PAD, EOS, BOS and END_TURN (special),
and character c is ord(c) + 4."""

PAD, EOS, BOS, END_TURN = 0, 1, 2, 3
_FIRST_CHAR = 4


class CharTokenizer:
    eos_id = EOS
    pad_id = PAD
    stop_ids = (EOS, END_TURN)

    def encode(self, text):
        return [ord(c) + _FIRST_CHAR for c in text]

    def decode(self, ids, *, skip_special_tokens=True):
        out = []
        for i in ids:
            if i < _FIRST_CHAR:
                if not skip_special_tokens:
                    out.append(f"<{i}>")
                continue
            out.append(chr(i - _FIRST_CHAR))
        return "".join(out)

    @staticmethod
    def render(messages, add_generation_prompt=True):
        """The chat as text: `role: content` lines, then `assistant: `."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tokenize=True,
                            **kwargs):
        text = self.render(messages, add_generation_prompt)
        return [BOS, *self.encode(text)] if tokenize else text
