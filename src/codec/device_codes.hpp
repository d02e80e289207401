// The wire codes the device coders' steps write and compare, as the integers their plans hold
// (docs/format.md; the enums of ciera/codec.hpp, ciera/dtype.hpp and entropy/stream_header.hpp).
#pragma once

#include <cstdint>

#include "ciera/codec.hpp"
#include "ciera/dtype.hpp"
#include "entropy/stream_header.hpp"

namespace ciera::codec::device {

inline constexpr uint32_t kKeyFrame = static_cast<uint32_t>(FrameKind::kKey);
inline constexpr uint32_t kExponentDeltaFrame = static_cast<uint32_t>(FrameKind::kDelta);
inline constexpr uint32_t kValueDeltaFrame = static_cast<uint32_t>(FrameKind::kValueDelta);
inline constexpr uint32_t kFullSection = static_cast<uint32_t>(ExponentSection::kFull);
inline constexpr uint32_t kUnchangedSection = static_cast<uint32_t>(ExponentSection::kUnchanged);
inline constexpr uint32_t kBlockSection = static_cast<uint32_t>(ExponentSection::kBlock);
inline constexpr uint32_t kFineSection = static_cast<uint32_t>(ExponentSection::kFine);
inline constexpr uint32_t kDifferencesSection =
    static_cast<uint32_t>(ExponentSection::kDifferences);
inline constexpr uint32_t kPackedStream = static_cast<uint32_t>(entropy::StreamMethod::kPacked);
inline constexpr uint32_t kConstantStream = static_cast<uint32_t>(entropy::StreamMethod::kConstant);
inline constexpr uint32_t kRansStream = static_cast<uint32_t>(entropy::StreamMethod::kRans);
inline constexpr uint32_t kBf16Code = static_cast<uint32_t>(DType::kBF16);
inline constexpr uint32_t kFp16Code = static_cast<uint32_t>(DType::kFP16);
inline constexpr uint32_t kFp32Code = static_cast<uint32_t>(DType::kFP32);

}  // namespace ciera::codec::device
