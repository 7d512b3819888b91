"""Operations: health, metrics, tokenize, cache administration and models at run time."""
