// Umbrella header for the CIERA library.
#pragma once

#include "ciera/backend.hpp"
#include "ciera/codec.hpp"
#include "ciera/config.hpp"
#include "ciera/dtype.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "ciera/version.hpp"
