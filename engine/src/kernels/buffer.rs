//! Zeroed byte buffers for the data the kernels stream through (packed weights, the
//! KV cache): 64-byte aligned, and, when large, an anonymous mapping advised to use
//! huge pages. Decode reads every weight and every live KV block once per step, at
//! places 4 KiB pages scatter over thousands of TLB entries; with 2 MiB pages a
//! page walk is rare.

/// Bytes from which a buffer is mapped (and advised to use huge pages).
const HUGE: usize = 2 << 20;
/// Alignment of a buffer's start (a cache line, and a 512-bit vector).
const ALIGN: usize = 64;

/// A zeroed, 64-byte-aligned byte buffer of fixed length.
#[derive(Debug)]
pub struct ZeroedBuffer {
    storage: Storage,
    offset: usize,
    len: usize,
}

#[derive(Debug)]
enum Storage {
    Heap(Vec<u8>),
    Mapped(memmap2::MmapMut),
}

impl ZeroedBuffer {
    /// `len` zero bytes: mapped when at least 2 MiB (a mapping is page-aligned and
    /// zero-filled by the kernel, so nothing is written until used), else on the heap.
    #[must_use]
    pub fn new(len: usize) -> Self {
        if len >= HUGE
            && let Ok(map) = memmap2::MmapMut::map_anon(len)
        {
            // Only a hint: without transparent huge pages the mapping still works.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            return Self {
                storage: Storage::Mapped(map),
                offset: 0,
                len,
            };
        }
        let storage = vec![0u8; len + ALIGN];
        let offset = storage.as_ptr().align_offset(ALIGN).min(ALIGN);
        Self {
            storage: Storage::Heap(storage),
            offset,
            len,
        }
    }

    /// The bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(v) => &v[self.offset..self.offset + self.len],
            Storage::Mapped(m) => &m[..self.len],
        }
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Heap(v) => &mut v[self.offset..self.offset + self.len],
            Storage::Mapped(m) => &mut m[..self.len],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_buffers_are_zeroed_aligned_and_writable() {
        for len in [0, 1, 100, HUGE, HUGE + 3] {
            let mut b = ZeroedBuffer::new(len);
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            assert_eq!(b.bytes().as_ptr().align_offset(ALIGN), 0, "{len}");
            if let Some(last) = b.bytes_mut().last_mut() {
                *last = 7;
            }
            assert_eq!(
                b.bytes().iter().map(|&x| usize::from(x)).sum::<usize>(),
                7 * usize::from(len > 0)
            );
        }
    }
}
