"""transformers as the reference for end-to-end tests: greedy generation from a checkpoint."""

from __future__ import annotations

import torch
import transformers


def transformers_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens after each prompt from ``transformers.generate`` on the checkpoint
    directory ``path`` (fp32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():  # explicit mask: a pad id would otherwise mask that token
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(gen[0, len(prompt) :].tolist())
    return out
