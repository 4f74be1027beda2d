"""Model classes the SGLang servers this sampler launches load instead of SGLang's own of the same architecture name
(SGLang's out-of-tree model hook: the launcher sets SGLANG_EXTERNAL_MODEL_PACKAGE to this package, whose modules'
EntryClass entries overwrite SGLang's registry). Each is SGLang's class with what LoRA serving lacks in SGLang 0.5.17
added, nothing else; imported only inside an SGLang server process."""
