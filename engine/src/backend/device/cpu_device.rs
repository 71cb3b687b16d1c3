//! [`CpuDevice`]: the [`Device`] whose buffers are host vectors and whose kernels are
//! the CPU twins. It is the reference the GPU is tested against, and it runs the whole
//! device forward pass on machines without a GPU.

use std::ops::Range;

use super::twin::{self, KvParams, MatShape, QuantFormat, SampleParams};
use super::{Checked, Device, DeviceError, Elem, RopeParams};

/// The host device: buffers are vectors, kernels are the CPU twins.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDevice;

// Every `launch_*` below runs on operands the provided method of `Device` checked, so
// the slicing cannot go out of bounds (the `Checked` argument is that proof).
impl Device for CpuDevice {
    type Buf<T: Elem> = Vec<T>;

    fn name(&self) -> String {
        "cpu-twin".into()
    }

    fn zeros<T: Elem>(&self, len: usize) -> Result<Vec<T>, DeviceError> {
        Ok(vec![T::default(); len])
    }

    fn upload<T: Elem>(&self, src: &[T]) -> Result<Vec<T>, DeviceError> {
        Ok(src.to_vec())
    }

    fn len<T: Elem>(&self, buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn free_memory(&self) -> Result<Option<usize>, DeviceError> {
        Ok(None)
    }

    fn write_unchecked<T: Elem>(
        &self,
        dst: &mut Vec<T>,
        src: &[T],
        _: Checked,
    ) -> Result<(), DeviceError> {
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read_unchecked<T: Elem>(
        &self,
        src: &Vec<T>,
        range: Range<usize>,
        _: Checked,
    ) -> Result<Vec<T>, DeviceError> {
        Ok(src[range].to_vec())
    }

    fn launch_embed(
        &self,
        fmt: QuantFormat,
        table: &Vec<u8>,
        tokens: &Vec<u32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::embed(fmt, table, &tokens[..n], out, dim);
        Ok(())
    }

    fn launch_rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: &Vec<u32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::rms_norm(x, w, &rows[..n], out, dim, eps);
        Ok(())
    }

    fn launch_add_rms_norm(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        n: usize,
        dim: usize,
        eps: f32,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::add_rms_norm(x, y, w, out, n, dim, eps);
        Ok(())
    }

    fn launch_add(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        len: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::add(x, y, len);
        Ok(())
    }

    fn launch_matmul(
        &self,
        fmt: QuantFormat,
        w: &Vec<u8>,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        s: MatShape,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::matmul(fmt, w, x, y, s);
        Ok(())
    }

    fn launch_silu_mul(
        &self,
        gate_up: &Vec<f32>,
        out: &mut Vec<f32>,
        ffn: usize,
        n: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::silu_mul(gate_up, out, ffn, n);
        Ok(())
    }

    fn launch_rope_store_kv(
        &self,
        qkv: &mut Vec<f32>,
        pos: &Vec<u32>,
        slots: &Vec<u32>,
        k_cache: &mut Vec<u16>,
        v_cache: &mut Vec<u16>,
        kv: &KvParams,
        rope: RopeParams,
        n: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::rope_store_kv(
            qkv,
            &pos[..n],
            &slots[..n],
            k_cache,
            v_cache,
            kv,
            rope.rope_dims,
            rope.theta_scale,
        );
        Ok(())
    }

    fn launch_paged_attention(
        &self,
        qkv: &Vec<f32>,
        k_cache: &Vec<u16>,
        v_cache: &Vec<u16>,
        block_tables: &Vec<u32>,
        table_off: &Vec<u32>,
        pos: &Vec<u32>,
        out: &mut Vec<f32>,
        kv: &KvParams,
        scale: f32,
        n: usize,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::paged_attention(
            qkv,
            k_cache,
            v_cache,
            block_tables,
            &table_off[..n],
            &pos[..n],
            out,
            kv,
            scale,
        );
        Ok(())
    }

    fn launch_argmax_rows(
        &self,
        logits: &Vec<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Vec<u32>,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::argmax_rows(&logits[..rows * vocab], vocab, &mut out[..rows]);
        Ok(())
    }

    fn launch_sample_top_k_top_p(
        &self,
        logits: &Vec<f32>,
        _scratch: &mut Vec<f32>,
        rows: Range<usize>,
        vocab: usize,
        p: SampleParams,
        uniforms: &Vec<f32>,
        out: &mut Vec<u32>,
        _: Checked,
    ) -> Result<(), DeviceError> {
        twin::sample_top_k_top_p(
            &logits[rows.start * vocab..rows.end * vocab],
            vocab,
            p,
            &uniforms[rows.clone()],
            &mut out[rows],
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The twin refuses operands that do not fit with the same typed error the GPU
    /// returns, where calling the twin kernel directly would panic on a slice.
    #[test]
    fn wrong_shapes_are_a_shape_error_not_a_panic() {
        let d = CpuDevice;
        let shape_err = |r: Result<(), DeviceError>| {
            assert!(matches!(r, Err(DeviceError::Shape(_))), "{r:?}");
        };
        // Three tokens asked for, two in the buffer (the twin slices tokens[..n]).
        let table = vec![0u8; 4 * QuantFormat::Q8_0.block_bytes()];
        let mut out = vec![0f32; 3 * 32];
        shape_err(d.embed(QuantFormat::Q8_0, &table, &vec![0; 2], &mut out, 3, 32));
        // Argmax over rows the output cannot hold.
        shape_err(d.argmax_rows(&vec![0.0; 8], 2, 4, &mut vec![0; 1]));
        // Sampling without a uniform per row, and with parameters out of range.
        let p = SampleParams {
            top_k: 4,
            top_p: 1.0,
            temperature: 1.0,
        };
        let (logits, mut scratch) = (vec![0f32; 8], vec![0f32; 8]);
        shape_err(d.sample_top_k_top_p(
            &logits,
            &mut scratch,
            0..2,
            4,
            p,
            &vec![0.5],
            &mut vec![0; 2],
        ));
        let p0 = SampleParams { top_k: 0, ..p };
        shape_err(d.sample_top_k_top_p(
            &logits,
            &mut scratch,
            0..2,
            4,
            p0,
            &vec![0.5; 2],
            &mut vec![0; 2],
        ));
        // A matrix whose columns are not whole blocks.
        let s = MatShape {
            rows: 1,
            cols: 33,
            n: 1,
            ldy: 1,
            yoff: 0,
        };
        shape_err(d.matmul(
            QuantFormat::Q8_0,
            &vec![0; 64],
            &vec![0.0; 33],
            &mut vec![0.0; 1],
            s,
        ));
        // Attention positions for fewer tokens than asked.
        let kv = KvParams {
            layer: 0,
            num_blocks: 1,
            block_size: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 32,
        };
        let cache = vec![0u16; kv.cache_len(1)];
        shape_err(d.paged_attention(
            &vec![0.0; 2 * kv.qkv_width()],
            &cache,
            &cache,
            &vec![0],
            &vec![0; 2],
            &vec![0; 1],
            &mut vec![0.0; 64],
            &kv,
            1.0,
            2,
        ));
        // Reading past a buffer.
        assert!(matches!(
            d.read(&vec![0u32; 2], 3),
            Err(DeviceError::Shape(_))
        ));
        // And the same operands that fit run.
        d.argmax_rows(&vec![0.0, 1.0, 2.0, 0.0], 2, 2, &mut vec![0; 2])
            .expect("fitting operands");
    }
}
