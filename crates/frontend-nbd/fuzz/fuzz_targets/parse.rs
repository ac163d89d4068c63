//! Fuzz target for every NBD decoder in `keel_nbd::protocol`: the client flags, option headers
//! and option data of the handshake, and request headers with the request checker. The first
//! input byte picks the decoder; the rest is its input. Properties: no decoder panics, and every
//! request the checker accepts is aligned, in bounds and within the payload limit.
//!
//! Run with `cargo +nightly fuzz run parse` from `crates/frontend-nbd` (see `../Cargo.toml`).
#![no_main]

use keel_nbd::protocol::{
    check_request, parse_client_flags, parse_option, Command, ExportGeometry, OptionHeader,
    RequestHeader, CLIENT_FLAGS_BYTES, OPTION_HEADER_BYTES, REQUEST_HEADER_BYTES,
};
use keel_nbd::REQUEST_PAYLOAD_MAX_BYTES;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&selector, data)) = input.split_first() else {
        return;
    };
    match selector % 4 {
        0 => {
            if let Ok(bytes) = <[u8; CLIENT_FLAGS_BYTES]>::try_from(data) {
                let _ = parse_client_flags(bytes);
            }
        }
        1 => {
            if let Some(bytes) = data.get(..OPTION_HEADER_BYTES) {
                let header: &[u8; OPTION_HEADER_BYTES] = bytes.try_into().expect("sliced to size");
                let _ = OptionHeader::parse(header);
            }
        }
        2 => {
            if let Some((code, rest)) = data.split_first_chunk::<4>() {
                let _ = parse_option(u32::from_be_bytes(*code), rest);
            }
        }
        _ => {
            let Some((header, geometry)) = data.split_first_chunk::<REQUEST_HEADER_BYTES>() else {
                return;
            };
            let Ok(header) = RequestHeader::parse(header) else {
                return;
            };
            let size_bytes = geometry.get(..8).map_or(1 << 30, |bytes| {
                u64::from_be_bytes(bytes.try_into().expect("8 bytes"))
            });
            let shift = geometry.get(8).map_or(12, |shift| u32::from(*shift % 17));
            let geometry = ExportGeometry {
                size_bytes,
                minimum_block_size_bytes: 1 << shift,
                preferred_block_size_bytes: (1 << shift).max(512),
                read_only: geometry.get(9).is_some_and(|flag| flag & 1 == 1),
            };
            if let Ok(command) = check_request(&header, &geometry) {
                if let Command::Read { offset, length } | Command::Write { offset, length, .. } =
                    command
                {
                    assert!(length <= REQUEST_PAYLOAD_MAX_BYTES);
                    assert!(offset + u64::from(length) <= geometry.size_bytes);
                    assert!(offset % u64::from(geometry.minimum_block_size_bytes) == 0);
                }
            }
        }
    }
});
