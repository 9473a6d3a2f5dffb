"""The policy losses, one module each: its formula, its knobs and its
`ENTRIES` (`loss_entry.LossEntry`), which `loss_registry` collects. A new
loss is a new module here."""
