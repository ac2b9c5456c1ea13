//! Criterion microbenchmarks live in `benches/`; this library is empty.
