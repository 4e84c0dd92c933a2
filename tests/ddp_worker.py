"""Worker of test_multiprocess.py: three optimizer steps on two examples of very different response
lengths (2 and 32 target tokens); run alone (1 process, batch 2) or under torchrun (2 processes,
batch 1 each). The main process saves the trained weights to argv[1]. (Three steps, not one:
AdamW's first update is about lr * sign(gradient), which hides how the processes are weighted.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402

from test_train import tiny_skipmodel  # noqa: E402

from skipdecode.data import Example  # noqa: E402
from skipdecode.train import TrainConfig, tokenize_examples, train  # noqa: E402

PROMPT = "Describe the restaurant in one sentence.\nname[The Eagle]\nDescription:"
LONG = "The Eagle is a moderately priced French coffee shop by the riverside near the lazy river bank " * 3


def main(out: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))  # not PartialState(): it would fix cpu=False first
    sk = tiny_skipmodel(chat=False)
    exs = [Example(PROMPT, "Eagle"), Example(PROMPT + " ", LONG)]
    P = len(tokenize_examples(sk.tokenizer, exs[:1], chat=False, max_length=512)[0][0].prompt_ids)
    max_length = P + 1 + 32
    items, _ = tokenize_examples(sk.tokenizer, exs, chat=False, max_length=max_length)
    lengths = sorted(len(x.response_ids) for x in items)
    assert lengths == [2, 32], lengths  # 1 token + EOS; the long one cut to 32 tokens
    trained = {}
    for prompt_grad in (True, False):  # the prompt without gradient takes another forward path
        model = sk if prompt_grad else tiny_skipmodel(chat=False)
        config = TrainConfig(out_dir=f"{run_dir}-{prompt_grad}", speedup=2.0, batch_size=2 // world, max_steps=3,
                             lr=1e-3, warmup_ratio=0.0, progress=False, max_length=max_length, seed=0,
                             prompt_grad=prompt_grad)
        train(model, exs, config)
        trained[prompt_grad] = {k: v.detach().cpu() for k, v in model.model.state_dict().items()}
    if PartialState().is_main_process:
        torch.save(trained, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
