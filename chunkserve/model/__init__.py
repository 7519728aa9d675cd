"""The model: architectures (models/), their building blocks (layers/), paged attention
(attention/), the C and Triton kernels under both (kernels/), checkpoint readers (loaders/);
`factory.load_model` assembles them, `batch` holds one step's flat input arrays."""
