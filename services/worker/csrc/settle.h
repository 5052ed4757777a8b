// settle(v): v, but the compiler must hold it in a register at this point (an empty asm that reads
// and writes it). GCC otherwise moved work across it in ways that cost registers: it parked an
// accumulator on the stack when a loop's live vectors came near the register file's size (the AVX2
// bf16 tiles, the AVX2 decode attention's V sums), and reassociated the widened int8 tiles' integer
// sums so that the even k's products of every row waited in registers (spilled) for the odd ones.
#pragma once

template <class V>
inline void settle(V& v) {
  __asm__("" : "+v"(v));
}
