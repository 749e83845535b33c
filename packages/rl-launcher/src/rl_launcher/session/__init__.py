"""What a run holds and how it starts: the starting model and tokenizer (:mod:`.model`),
the :class:`~.run.Run` every loop is given, and the start-up order that fills it
(:mod:`.start`)."""
