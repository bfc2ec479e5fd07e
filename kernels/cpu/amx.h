// AMX's tile registers, shared by the kernels that use them (bf16_linear.cpp's matmul,
// paged_attention.cpp's bf16 decode attention).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>

namespace lamina {

// A tile configuration (palette 1) as ldtilecfg reads it from memory: tile t has rows[t]
// rows of colsb[t] bytes. Kernels load one from a constant in memory (a local copy's
// stores were optimized away before the load).
struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes, the most palette 1 allows.
alignas(64) inline constexpr TileConfig kFullTiles = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

#if defined(__x86_64__)
// This thread's tiles shaped by `config` (zeroed), and given back when it is done.
__attribute__((target("amx-tile"))) inline void load_tiles(const TileConfig* config) {
  _tile_loadconfig(config);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// Whether this process may use AMX's tile registers (Linux asks each process to request
// them once: ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; refused where the CPU has none).
inline bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}
#else
inline bool tiles_permitted() { return false; }
#endif

}  // namespace lamina
