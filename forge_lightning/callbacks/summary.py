"""The model summary ``forge`` prints at the start of ``fit``, without FLOPs that were never counted."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

# Column styles of Lightning's RichModelSummary table.
_COLUMNS: dict[str, dict[str, Any]] = {
    " ": {"style": "dim"},
    "Name": {"justify": "left", "no_wrap": True},
    "Params": {"justify": "right"},
    "Params per Device": {"justify": "right"},
    "In sizes": {"justify": "right", "style": "white"},
    "Out sizes": {"justify": "right", "style": "white"},
}


class ForgeModelSummary(RichModelSummary):
    """Lightning's rich model summary, leaving out the FLOPs column and total when nothing counted FLOPs.

    Lightning 2.6 counts FLOPs only by running the module's ``example_input_array``; forge modules set none (a
    batch's shape comes from the data), so the summary would print ``Total FLOPs: 0``. Training FLOPs are
    measured per batch from the module's ``batch_stats`` by
    :class:`~forge_lightning.callbacks.ThroughputMonitor`. A module that sets ``example_input_array`` gets
    Lightning's summary with its FLOPs. ``forge`` adds this summary unless ``trainer.callbacks`` has one or
    ``trainer.enable_model_summary`` is false.

    Args:
        max_depth: the depth of nested modules listed (0: no table).
        **summarize_kwargs: passed to :meth:`summarize` (``header_style``).
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, **_COLUMNS.get(name, {}))
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        totals = Table.grid(expand=True)
        for label, value in (
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(totals)
