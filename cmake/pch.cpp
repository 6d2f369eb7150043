// The translation unit that builds the one precompiled header (<torch/torch.h>) which every torch
// translation unit of Strobe reuses (target strobe_pch, strobe/CMakeLists.txt).
