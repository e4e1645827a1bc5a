"""A small GPT-2 trained by the Hugging Face Trainer with a decentralized optimizer.

    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_trainer.py
    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_trainer.py --resume

Against a stock Trainer script, three lines change: the import, ``Trainer`` ->
``DecentralizedTrainer``, and ``optimizer_cls_and_kwargs``. The data are random tokens, so the
loss only shows that training runs; put your tokenised data set in their place.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import decent_optim as dopt
from decent_optim.integrations.hf import DecentralizedTrainer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, 32), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--out", default="hf-trainer-run", help="checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    args = parser.parse_args()

    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        save_steps=args.steps // 2,
        eval_strategy="steps",
        eval_steps=args.steps // 2,
        logging_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = DecentralizedTrainer(  # was: Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(2048, seed=0),
        eval_dataset=RandomTokens(64, seed=1),
        # was: the Trainer's default AdamW
        optimizer_cls_and_kwargs=(dopt.DecentralizedAdamW, {"lr": 1e-3, "topology": "ring"}),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()  # every rank: the consensus model, averaged over the ranks
    trainer.save_model(f"{args.out}/final")  # every rank; rank 0 writes the consensus model
    if trainer.is_world_process_zero():
        print(f"eval loss of the consensus model: {metrics['eval_loss']:.4f}")
    if torch.distributed.is_initialized():  # gloo's threads must not outlive the interpreter
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
