"""The embedded demo and test fixtures, apart from the framework: the tiny checkpoint builder (``tiny``: tokenizer,
chat template, processor, random weights of a family's tiny sizes), its format warm-up (``tiny_warmup``) and the
synthetic geo3k-style data set (``synthetic``). ``ascendfactory-cli config --af_model_name tiny*``, the tests and
the benches use them; nothing in the framework does."""
